"""Jobs and events of the web UI's control plane (A5).

A job is one model action or download, run on its own thread; model actions take one lock so
two loads never race. Every change of a job, every model state change and a periodic counters
sample go into one `EventLog`, which the SSE route reads by sequence number.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})


class JobCancelled(Exception):
    """Raised inside a job's work when it saw its cancel flag."""


class EventLog:
    """A bounded, thread-safe list of events with increasing sequence numbers."""

    def __init__(self, max_events: int = 2000) -> None:
        self._events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self._seq = itertools.count(1)
        self._lock = threading.Lock()

    def publish(self, kind: str, data: dict[str, Any]) -> None:
        with self._lock:
            self._events.append({"seq": next(self._seq), "event": kind, "time": time.time(), "data": data})

    def since(self, seq: int) -> list[dict[str, Any]]:
        with self._lock:
            return [event for event in self._events if event["seq"] > seq]

    @property
    def last_seq(self) -> int:
        with self._lock:
            return self._events[-1]["seq"] if self._events else 0


@dataclass
class Job:
    """One control-plane action; `to_json` is what the UI sees."""

    kind: str  # load | unload | switch | download | load_embedding | ...
    target: str | None
    id: str = field(default_factory=lambda: f"job-{uuid.uuid4().hex[:12]}")
    state: str = "queued"  # queued | running | succeeded | failed | cancelled
    progress: float = 0.0  # 0..1
    message: str = ""
    error: str | None = None
    result: dict[str, Any] | None = None
    created: float = field(default_factory=time.time)
    finished: float | None = None
    cancel_requested: threading.Event = field(default_factory=threading.Event)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "target": self.target, "state": self.state,
                "progress": round(self.progress, 4), "message": self.message, "error": self.error,
                "result": self.result, "created": self.created, "finished": self.finished}

    @property
    def is_done(self) -> bool:
        return self.state in TERMINAL_STATES

    def check_cancel(self) -> None:
        if self.cancel_requested.is_set():
            raise JobCancelled(self.id)


Work = Callable[[Job], dict[str, Any] | None]


class JobRunner:
    """Starts jobs on threads, keeps their records and publishes every change."""

    def __init__(self, events: EventLog, max_jobs: int = 200) -> None:
        self.events = events
        self.model_lock = threading.Lock()  # one model action at a time
        self._jobs: dict[str, Job] = {}
        self._max_jobs = max_jobs
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def submit(self, kind: str, target: str | None, work: Work, *, is_model_action: bool = True) -> Job:
        job = Job(kind, target)
        with self._lock:
            self._jobs[job.id] = job
            self._forget_old()
        self.update(job)
        thread = threading.Thread(target=self._run, args=(job, work, is_model_action), name=f"mlxcel-{job.id}",
                                  daemon=True)
        self._threads.append(thread)
        thread.start()
        return job

    def _forget_old(self) -> None:
        done = [job for job in self._jobs.values() if job.is_done]
        for job in done[: max(len(self._jobs) - self._max_jobs, 0)]:
            del self._jobs[job.id]

    def _run(self, job: Job, work: Work, is_model_action: bool) -> None:
        lock = self.model_lock if is_model_action else _NO_LOCK
        with lock:
            try:
                job.check_cancel()
                self.update(job, state="running")
                result = work(job)
                self.update(job, state="succeeded", progress=1.0, result=result, message=job.message or "done")
            except JobCancelled:
                self.update(job, state="cancelled", message="cancelled")
            except Exception as exc:  # noqa: BLE001 - the job reports it; the server keeps running
                log.warning("job %s (%s %s) failed: %s", job.id, job.kind, job.target, exc)
                self.update(job, state="failed", error=str(exc) or type(exc).__name__)

    def update(self, job: Job, **changes: Any) -> None:
        for name, value in changes.items():
            setattr(job, name, value)
        if job.is_done and job.finished is None:
            job.finished = time.time()
        self.events.publish("job", job.to_json())

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def list(self) -> list[Job]:
        with self._lock:
            return sorted(self._jobs.values(), key=lambda job: job.created, reverse=True)

    def cancel(self, job: Job) -> None:
        job.cancel_requested.set()
        if job.state == "queued":
            self.events.publish("job", job.to_json())

    def join(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(end - time.monotonic(), 0.0))
        return not any(thread.is_alive() for thread in self._threads)


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_LOCK = _NoLock()
