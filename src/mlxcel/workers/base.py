"""A side worker: one owner thread, a bounded request queue and a deadline per request.

The thread is the only code that runs the worker's model (DESIGN rule 4). A request is a
list of items; the thread takes the oldest request, adds more queued requests while they
fit in one batch, and runs `forward` on at most `batch_size` items at a time. A full
queue refuses at once (`WorkerBusyError`, HTTP 503); a request not answered by its
deadline fails with `WorkerTimeoutError` (HTTP 504) and is skipped if still queued.

The deadline holds on the owner thread too (issue 47): a request past it is skipped before its
next batch, an answer finished past it is a 504 rather than a late 200 (a starved event loop
cannot turn one into the other), and a forward with steps of its own asks `is_past_deadline()`
between them (Florence-2's decoding, the image pipeline's denoising, Whisper's segments, speech
sentences) to stop the work nobody can receive any more.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

ItemT = TypeVar("ItemT")
OutT = TypeVar("OutT")

logger = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """Base of the errors a worker raises instead of answering."""


class WorkerBusyError(WorkerError):
    """The queue is full; the server answers 503."""


class WorkerTimeoutError(WorkerError):
    """The request was not answered before its deadline; the server answers 504."""


class WorkerStoppedError(WorkerError):
    """The worker is stopping or stopped (shutdown, A7); the server answers 503."""


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    queue_depth: int = 8  # requests waiting, not counting the one being computed
    batch_size: int = 16  # items per forward
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.queue_depth < 1 or self.batch_size < 1:
            raise ValueError("worker queue depth and batch size must be at least 1")
        if self.request_timeout_s <= 0:
            raise ValueError("worker request timeout must be positive")


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """Counters for /health and /metrics (K)."""

    name: str
    queue_depth: int  # requests waiting now
    max_queue_depth: int
    num_requests: int  # accepted
    num_completed: int
    num_failed: int
    num_rejected: int  # refused because the queue was full
    num_timed_out: int


@dataclass(slots=True)
class _Job(Generic[ItemT, OutT]):
    items: list[ItemT]
    deadline: float  # time.monotonic() seconds
    future: concurrent.futures.Future[list[OutT]] = field(default_factory=concurrent.futures.Future)
    outputs: list[OutT] = field(default_factory=list)
    num_done: int = 0
    is_timed_out: bool = False  # counted once, by whichever side (waiter or owner thread) saw it first


_STOP = object()  # queue sentinel: the owner thread exits when it reads it


class BatchWorker(Generic[ItemT, OutT]):
    """Runs `forward(items) -> outputs` (same length, same order) on its own thread.

    `sort_key` (e.g. token length) orders the items of the requests taken together before
    they are cut into batches, so each batch pads little.
    """

    def __init__(
        self,
        name: str,
        forward: Callable[[list[ItemT]], list[OutT]],
        config: WorkerConfig = WorkerConfig(),
        sort_key: Callable[[ItemT], int] | None = None,
    ) -> None:
        self.name = name
        self.config = config
        self._forward = forward
        self._sort_key = sort_key
        self._queue: queue.Queue[_Job[ItemT, OutT] | object] = queue.Queue(config.queue_depth)
        self._lock = threading.Lock()  # orders submit against stop
        self._is_stopping = False
        self._counts = {"requests": 0, "completed": 0, "failed": 0, "rejected": 0, "timed_out": 0}
        self._batch_deadline: float | None = None  # the running batch's latest deadline (owner thread only)
        self._thread = threading.Thread(target=self._loop, name=f"mlxcel-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._is_stopping

    def submit(self, items: Sequence[ItemT]) -> concurrent.futures.Future[list[OutT]]:
        """Queue one request; the future holds its outputs. Raises WorkerBusyError when full."""
        return self._submit(items).future

    def _submit(self, items: Sequence[ItemT]) -> _Job[ItemT, OutT]:
        if not items:
            raise ValueError(f"a {self.name} request needs at least one input")
        job: _Job[ItemT, OutT] = _Job(list(items), time.monotonic() + self.config.request_timeout_s)
        with self._lock:
            if self._is_stopping or not self._thread.is_alive():
                raise WorkerStoppedError(f"the {self.name} worker is not running")
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                self._counts["rejected"] += 1  # under the lock already
                raise WorkerBusyError(
                    f"the {self.name} queue is full ({self.config.queue_depth} requests waiting); "
                    "retry later"
                ) from None
            self._counts["requests"] += 1
        return job

    async def run(self, items: Sequence[ItemT]) -> list[OutT]:
        """Submit and await the outputs, within the request timeout."""
        if not items:
            return []
        job = self._submit(items)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(job.future), self.config.request_timeout_s)
        except TimeoutError:
            raise self._timed_out(job) from None

    def run_sync(self, items: Sequence[ItemT]) -> list[OutT]:
        """Blocking `run`, for callers without an event loop (CLI, benchmarks)."""
        if not items:
            return []
        job = self._submit(items)
        try:
            return job.future.result(self.config.request_timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._timed_out(job) from None

    def stop(self, timeout: float | None = None) -> bool:
        """Refuse new requests, fail queued ones, let the current batch finish and join.

        Returns True when the thread ended within `timeout` (A7 reports an unclean exit
        otherwise).
        """
        with self._lock:
            self._is_stopping = True
        self._fail_queued(WorkerStoppedError(f"the {self.name} worker stopped"))
        if not self._thread.is_alive():
            return True
        self._queue.put(_STOP)  # room is certain: submit is closed and the queue drained
        self._thread.join(timeout)
        is_clean = not self._thread.is_alive()
        if not is_clean and timeout:  # a 0 s stop only asks (the A7 abort phase); the join comes later
            logger.warning("%s worker still running after %.0f s", self.name, timeout or 0)
        return is_clean

    def stats(self) -> WorkerStats:
        with self._lock:
            counts = dict(self._counts)
        return WorkerStats(
            name=self.name,
            queue_depth=self._queue.qsize(),
            max_queue_depth=self.config.queue_depth,
            num_requests=counts["requests"],
            num_completed=counts["completed"],
            num_failed=counts["failed"],
            num_rejected=counts["rejected"],
            num_timed_out=counts["timed_out"],
        )

    def is_past_deadline(self) -> bool:
        """On the owner thread, inside `forward`: every request of the running batch is past its deadline,
        so no one can receive what the forward is computing (check it between steps and stop)."""
        deadline = self._batch_deadline
        return deadline is not None and time.monotonic() > deadline

    def _timed_out(self, job: _Job[ItemT, OutT]) -> WorkerTimeoutError:
        job.future.cancel()  # still queued: the thread skips it; already running: it stops at its next check
        self._mark_timed_out(job)
        return self._late_error()

    def _late_error(self) -> WorkerTimeoutError:
        return WorkerTimeoutError(f"the {self.name} request took longer than {self.config.request_timeout_s:g} s")

    def _mark_timed_out(self, job: _Job[ItemT, OutT]) -> None:
        with self._lock:
            if not job.is_timed_out:
                job.is_timed_out = True
                self._counts["timed_out"] += 1

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _fail_queued(self, error: Exception) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, _Job) and job.future.set_running_or_notify_cancel():
                job.future.set_exception(error)

    # --- owner thread -------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if not isinstance(first, _Job):  # the stop sentinel
                return
            jobs, saw_stop = self._take_more([first])
            started = [job for job in jobs if self._can_start(job)]
            try:
                self._run_jobs(started)
            except Exception as exc:  # noqa: BLE001 - keep serving; fail only these requests
                logger.exception("%s worker: batch failed", self.name)
                self._fail_jobs(started, exc)
            if saw_stop:
                return

    def _take_more(self, jobs: list[_Job[ItemT, OutT]]) -> tuple[list[_Job[ItemT, OutT]], bool]:
        # Add queued requests while their items fit in one batch with the first.
        num_items = len(jobs[0].items)
        while num_items < self.config.batch_size:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if not isinstance(job, _Job):
                return jobs, True
            jobs.append(job)
            num_items += len(job.items)
        return jobs, False

    def _can_start(self, job: _Job[ItemT, OutT]) -> bool:
        if not job.future.set_running_or_notify_cancel():
            return False  # cancelled: timed out while queued (counted by the waiter)
        if time.monotonic() > job.deadline:
            self._mark_timed_out(job)
            job.future.set_exception(WorkerTimeoutError(f"the {self.name} request expired in the queue"))
            return False
        job.outputs = [None] * len(job.items)  # type: ignore[list-item]
        return True

    def _run_jobs(self, jobs: list[_Job[ItemT, OutT]]) -> None:
        pending = [(job, index) for job in jobs for index in range(len(job.items))]
        if self._sort_key is not None:
            key = self._sort_key
            pending.sort(key=lambda entry: key(entry[0].items[entry[1]]))
        size = self.config.batch_size
        for start in range(0, len(pending), size):
            self._run_batch(pending[start : start + size])

    def _run_batch(self, batch: list[tuple[_Job[ItemT, OutT], int]]) -> None:
        live = [(job, index) for job, index in batch if not job.future.done() and not self._expire(job)]
        if not live:
            return
        self._batch_deadline = max(job.deadline for job, _ in live)
        try:
            outputs = self._forward([job.items[index] for job, index in live])
        except Exception as exc:  # noqa: BLE001 - the request's error, not the worker's
            self._fail_batch({id(job): job for job, _ in live}.values(), exc)
            return
        finally:
            self._batch_deadline = None
        for (job, index), output in zip(live, outputs, strict=True):
            job.outputs[index] = output
            job.num_done += 1
            if job.num_done == len(job.items) and not self._expire(job):
                self._count("completed")
                job.future.set_result(job.outputs)

    def _expire(self, job: _Job[ItemT, OutT]) -> bool:
        """Fail `job` with a 504 when it is past its deadline (its answer would come too late)."""
        if time.monotonic() <= job.deadline or job.future.done():
            return False
        self._mark_timed_out(job)
        job.future.set_exception(self._late_error())
        return True

    def _fail_batch(self, jobs: Iterable[_Job[ItemT, OutT]], exc: Exception) -> None:
        # A forward that stopped at its deadline (or any forward past it) ends its requests with a 504, not a 500.
        jobs = [job for job in jobs if not self._expire(job)]
        if jobs:
            logger.exception("%s worker: forward failed", self.name)
            self._fail_jobs(jobs, exc)

    def _fail_jobs(self, jobs: Iterable[_Job[ItemT, OutT]], error: Exception) -> None:
        for job in jobs:
            if not job.future.done():
                self._count("failed")
                job.future.set_exception(error)
