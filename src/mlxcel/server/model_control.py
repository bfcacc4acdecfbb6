"""Load, unload and switch the served models at run time, for the web UI's control plane (A5).

Every load goes through the startup path (the `Loader` startup hands in, `startup.ModelLoader`:
the chat model and the embedding and rerank providers load as `mlxcel serve` loads them at
startup; this module never imports startup) and is attached with `ServerState.attach`. A switch
loads the new model first, attaches it (new requests go to it), then retires the old one:
"drain" lets its in-flight requests finish (up to a deadline, then aborts what is left), "abort"
ends them at once with finish_reason "abort". The old engine is stopped and its weights released.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mlxcel.server.jobs import EventLog, Job, JobCancelled, JobRunner

if TYPE_CHECKING:
    from mlxcel.loading import ResolvedModel
    from mlxcel.serving.process import SideModels
    from mlxcel.serving.served_model import ServedModel
    from mlxcel.server.state import ServerState

log = logging.getLogger(__name__)

RETIRE_MODES = ("drain", "abort")
DEFAULT_DRAIN_TIMEOUT_S = 120.0


class Loader(Protocol):
    """How models load at run time: the startup path's `startup.ModelLoader`."""

    @property
    def device(self) -> str: ...

    def resolve(self, model_id: str) -> ResolvedModel: ...

    def load_chat(self, resolved: ResolvedModel) -> ServedModel: ...

    def load_side(self, role: str, resolved: ResolvedModel) -> SideModels: ...


@dataclass
class ThroughputMeter:
    """Tokens per second between two engine samples at least `min_interval_s` apart."""

    min_interval_s: float = 0.5
    _last: tuple[float, int, int] | None = None
    _rates: tuple[float, float] = (0.0, 0.0)
    _owner: Any = field(default=None, repr=False)

    def sample(self, owner: Any, generated: int, prompt: int) -> tuple[float, float]:
        now = time.monotonic()
        if self._owner is not owner or self._last is None:  # a new engine starts its counters at 0
            self._owner, self._last, self._rates = owner, (now, generated, prompt), (0.0, 0.0)
            return self._rates
        then, last_generated, last_prompt = self._last
        if now - then >= self.min_interval_s:
            elapsed = now - then
            self._rates = ((generated - last_generated) / elapsed, (prompt - last_prompt) / elapsed)
            self._last = (now, generated, prompt)
        return self._rates


class ModelControl:
    """The web UI's hands on the server: model actions as jobs, their events, the model states."""

    def __init__(self, state: ServerState, settings: Loader, session_key: str | None = None) -> None:
        self.state = state
        self.settings = settings
        self.session_key = session_key
        self.events = EventLog()
        self.jobs = JobRunner(self.events)
        self.loading: dict[str, str] = {}  # role -> model id being loaded
        self.throughput = ThroughputMeter()

    # ---- resolving ----

    def resolve(self, model_id: str) -> ResolvedModel:
        """A catalog id: "" (the embedded default), a packaged name, a path, or a repo id in the store."""
        return self.settings.resolve(model_id)

    # ---- the chat model ----

    def load_chat(self, job: Job, model_id: str) -> dict[str, Any]:
        if self.state.served is not None:
            raise ValueError(f"{self.state.served.name} is already loaded: switch to replace it")
        served = self._start_chat(job, model_id)
        self.state.attach(served)
        self._publish_model("chat", "loaded", served.name)
        job.message = f"serving {served.name}"
        return {"model": served.name}

    def switch_chat(self, job: Job, model_id: str, mode: str, drain_timeout_s: float) -> dict[str, Any]:
        old = self.state.served
        served = self._start_chat(job, model_id)
        self.state.attach(served)  # new requests go to the new model from here on
        self._publish_model("chat", "loaded", served.name)
        retired = self._retire(job, old, mode, drain_timeout_s) if old is not None else None
        job.message = f"serving {served.name}"
        return {"model": served.name, "previous": old.name if old else None, **(retired or {})}

    def unload_chat(self, job: Job, mode: str, drain_timeout_s: float) -> dict[str, Any]:
        old = self.state.served
        if old is None:
            raise ValueError("no chat model is loaded")
        self.state.detach()  # new requests get 503 "no model loaded"
        return {"previous": old.name, **self._retire(job, old, mode, drain_timeout_s)}

    def _start_chat(self, job: Job, model_id: str) -> ServedModel:
        resolved = self.resolve(model_id)
        job.message = f"loading {resolved.name}"
        self.jobs.update(job, progress=0.1)
        self.loading["chat"] = resolved.name
        self._publish_model("chat", "loading", resolved.name)
        try:
            served = self.settings.load_chat(resolved)
        except BaseException:
            self._publish_model("chat", "failed", resolved.name)
            raise
        finally:
            self.loading.pop("chat", None)
        if job.cancel_requested.is_set():  # cancelled while loading: never attach it
            served.close(30.0)
            raise JobCancelled(job.id)
        return served

    def _retire(self, job: Job, old: ServedModel, mode: str, drain_timeout_s: float) -> dict[str, Any]:
        """Stop serving `old`: drain its requests (then abort leftovers) or abort at once; free it."""
        self._publish_model("chat", "unloading", old.name)
        job.message = f"{'draining' if mode == 'drain' else 'aborting'} {old.name}"
        self.jobs.update(job, progress=0.8)
        is_drained = mode == "drain" and _wait_idle(old, drain_timeout_s)
        old.close(30.0)  # aborts whatever is still running (finish_reason "abort")
        name = old.name
        del old
        release_memory(self.settings.device)
        self._publish_model("chat", "unloaded", name)
        job.message = f"unloaded {name}" + ("" if is_drained or mode == "abort" else " (drain deadline: aborted the rest)")
        return {"retired": name, "drained": is_drained}

    # ---- side models (spec I) ----

    def load_side(self, job: Job, role: str, model_id: str) -> dict[str, Any]:
        if self._side_name(role) is not None:
            raise ValueError(f"an {role} model is already loaded: unload it first")
        resolved = self.resolve(model_id)
        self._publish_model(role, "loading", resolved.name)
        try:
            loaded = self.settings.load_side(role, resolved)
        except BaseException:
            self._publish_model(role, "failed", resolved.name)
            raise
        side = self.state.side
        if role == "embedding":
            side.embedding, side.embedding_info = loaded.embedding, loaded.embedding_info
        else:
            side.reranker, side.reranker_info = loaded.reranker, loaded.reranker_info
        side.stoppers.extend(loaded.stoppers)
        self._publish_model(role, "loaded", resolved.name)
        job.message = f"serving {resolved.name} as the {role} model"
        return {"model": resolved.name}

    def unload_side(self, job: Job, role: str) -> dict[str, Any]:
        side = self.state.side
        name = self._side_name(role)
        if name is None:
            raise ValueError(f"no {role} model is loaded")
        provider = side.embedding if role == "embedding" else side.reranker
        if role == "embedding":
            side.embedding, side.embedding_info = None, None
        else:
            side.reranker, side.reranker_info = None, None
        side.stoppers[:] = [(n, stop) for n, stop in side.stoppers if stop != provider.stop]  # type: ignore[union-attr]
        provider.stop(30.0)  # type: ignore[union-attr]
        del provider
        release_memory(self.settings.device)
        self._publish_model(role, "unloaded", name)
        job.message = f"unloaded {name}"
        return {"retired": name}

    def _side_name(self, role: str) -> str | None:
        info = self.state.side.embedding_info if role == "embedding" else self.state.side.reranker_info
        return info.name if info is not None else None

    # ---- what the UI reads ----

    def model_states(self) -> dict[str, Any]:
        served = self.state.served
        chat = None
        if served is not None:
            chat = {"name": self.state.model_name, "model_type": served.loaded.model_type,
                    "path": str(served.loaded.path) if hasattr(served.loaded, "path") else None,
                    "context_size": served.context_size, "slots": served.engine_config.max_num_seqs}
        return {"chat": chat, "embedding": self._side_name("embedding"), "rerank": self._side_name("rerank"),
                "loading": dict(self.loading)}

    def loaded_paths(self) -> set[str]:
        """Resolved paths of every loaded model, so the catalog marks them and delete refuses them."""
        paths = set()
        served = self.state.served
        if served is not None and getattr(served.loaded, "path", None) is not None:
            paths.add(str(Path(served.loaded.path).resolve()))
        return paths

    def _publish_model(self, role: str, state: str, name: str) -> None:
        self.events.publish("model", {"role": role, "state": state, "name": name})

    def stop(self, timeout: float) -> bool:
        """Shutdown (A7): the served model and every side provider loaded so far."""
        end = time.monotonic() + timeout
        served = self.state.served
        is_clean = served.close(timeout) if served is not None else True
        for _, stop in list(self.state.side.stoppers):
            is_clean = stop(max(end - time.monotonic(), 0.0)) and is_clean
        return is_clean


def _wait_idle(served: ServedModel, timeout_s: float) -> bool:
    """Until the engine has no running or queued request twice in a row (a request that took the
    old context just before the switch has a moment to arrive); False at the deadline."""
    end = time.monotonic() + timeout_s
    idle_reads = 0
    while time.monotonic() < end:
        stats = served.engine.stats()
        idle_reads = idle_reads + 1 if stats.active_sequences == 0 and stats.queue_depth == 0 else 0
        if idle_reads >= 3:
            return True
        time.sleep(0.1)
    return False


def release_memory(device: str) -> None:
    """Give the old model's memory back: drop cycles, then the CUDA cache where there is one."""
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
