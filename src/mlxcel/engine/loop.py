"""The single owner of engine state: a thread that schedules, runs and samples, step after step.

Other threads talk to it only through its inbox (add, abort, control commands) and the
per-request sinks it calls with TokenEvents. Nothing else touches the batch, the KV pool
or the model (DESIGN.md rule 4).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mlxcel.config import EngineConfig
from mlxcel.engine.admission import MemoryBudget
from mlxcel.engine.decode_step import DecodeStep
from mlxcel.engine.kv import slot_files
from mlxcel.engine.kv.blocks import BlockPool
from mlxcel.engine.kv.disk import DiskBlockStore, DiskTierConfig, open_disk_tier
from mlxcel.engine.kv.host import HostBlockTier, default_host_bytes, open_host_tier
from mlxcel.engine.kv.prefix import KVCacheManager
from mlxcel.engine.kv.tensors import KVCache
from mlxcel.engine.kv.states import SnapshotPrefixCache, StatePool
from mlxcel.engine.recurrent_runner import RecurrentRunner
from mlxcel.engine.runner import Runner, StepLogits
from mlxcel.engine.sampler import PenaltyCounts, SamplingRow, sample
from mlxcel.engine.scheduler import (
    ChooseToken, ScheduledSeq, Scheduler, SchedulerOutput, Sequence, SlotContent, StepResult,
)
from mlxcel.engine.spec import DraftPolicy, build_policy
from mlxcel.layers import kv_quant
from mlxcel.layers.lora import model_lora_rows
from mlxcel.layers.recurrent import state_specs
from mlxcel.types import (
    ContextOverflowError, DraftStats, EngineShutdownError, EngineStats, FinishReason, PrefixCacheReset, PrefixCacheStats,
    PromptProgress,
    QueueFullError, Request, SlotStats, TokenEvent,
)

log = logging.getLogger(__name__)

# NOTE: the loop thread and the HTTP event loop share the GIL. At Python's default switch
# interval (5 ms) a thread that wants the GIL waits up to 5 ms for the other to yield it; a
# token's hand-off then cost ~5 ms on the lent GPU (7.7 -> 2.8 ms a token at batch 1, measured).
GIL_SWITCH_INTERVAL_S = 0.0002


Sink = Callable[[TokenEvent], None]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the engine needs to know of a model to size its KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    values_are_keys: bool = False  # MLA: the cache stores keys only (KVCache.values_are_keys)
    # (num_kv_heads, head_dim) of each KV layer where they differ (Gemma 4's global layers); None: all alike
    layer_shapes: tuple[tuple[int, int], ...] | None = None
    num_shared_layers: int = 0  # layers that read an earlier layer's KV and keep none (Gemma 4)

    @classmethod
    def of(cls, args: Any) -> ModelShape:
        """From a family's ModelArgs (every decoder family exposes the first four)."""
        # A hybrid keeps KV for its attention layers only; at least one layer (a model of recurrent layers alone).
        num_layers = max(getattr(args, "num_kv_layers", args.num_hidden_layers), 1)
        return cls(num_layers, args.kv_heads, args.dim_per_head, args.max_position_embeddings,
                   bool(getattr(args, "kv_values_are_keys", False)), getattr(args, "kv_layer_shapes", None),
                   int(getattr(args, "num_kv_shared_layers", 0) or 0))

    def kv_bytes_per_token(self, k_type: str, v_type: str) -> int:
        shapes = self.layer_shapes or ((self.num_kv_heads, self.head_dim),) * self.num_layers
        return sum(kv_quant.bytes_per_token(1, heads, dim, k_type, None if self.values_are_keys else v_type)
                   for heads, dim in shapes)

    def kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str,
                 k_type: str | None, v_type: str | None) -> KVCache:
        return KVCache(self.num_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim, dtype, device,
                       k_type=k_type, v_type=v_type, values_are_keys=self.values_are_keys,
                       layer_shapes=self.layer_shapes)


def _shape_counts(shapes: tuple[tuple[int, int], ...] | None) -> str:
    counts = {shape: (shapes or ()).count(shape) for shape in dict.fromkeys(shapes or ())}
    return ", ".join(f"{n} of {heads}x{dim}" for (heads, dim), n in counts.items()) or "all alike"


class EngineCore:
    def __init__(self, model: torch.nn.Module, shape: ModelShape, config: EngineConfig, *,
                 eos_token_ids: frozenset[int], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, drafts: DraftPolicy | None = None,
                 defer_events: bool | None = None, cache_identity: str = "") -> None:
        if config.is_turbo_kv and config.max_kv_size:  # spec N2
            log.warning("--max-kv-size %d is ignored: the live-window cap does not apply to Turbo-quantized KV "
                        "layers (--kv-cache-mode turbo4 / --kv-quant-scheme turboquant)", config.max_kv_size)
            config = replace(config, max_kv_size=0)
        self.config = config
        self.slot_context = config.slot_context(shape.context_length)
        k_type, v_type = config.kv_element_types()
        bytes_per_token = shape.kv_bytes_per_token(k_type, v_type)
        # Issue 41: a hybrid model's recurrent layers keep their states in a pool beside the blocks, and its
        # prefix cache hits only where a state snapshot exists (engine/kv/states.py); --kv-cache-memory holds both.
        self.drafts = drafts or build_policy(config.speculative)
        self.states = _state_pool(model, config, dtype, device, drafts=self.drafts)
        num_blocks = config.num_blocks(shape.context_length, bytes_per_token,
                                       state_bytes=self.states.num_bytes if self.states is not None else 0)
        self.kv_cache = shape.kv_cache(num_blocks, config.block_size, dtype, device, k_type, v_type)
        self.kv = KVCacheManager(BlockPool(num_blocks, config.block_size,
                                           enable_caching=config.enable_prefix_caching),
                                 enable_prefix_caching=config.enable_prefix_caching)
        # issue 29: the disk tier under the prefix cache; `cache_identity` names the model's KV (serving.served_model)
        identity = cache_identity and f"{cache_identity}|{dtype}|{device}"
        self.disk = _open_disk_tier(config, self.kv_cache, self.kv, identity)
        if self.states is not None and self.disk is not None:
            self.states.attach_disk(self.disk.folder)
            # Snapshots go to disk with their blocks, or alone when evicted first: a killed server's successor resumes.
            self.disk.sidecar, self.states.spill = self.states.export_snapshot, self.disk.save_sidecar
        self.host = _open_host_tier(config, self.kv_cache, self.kv, self.disk)  # point 5: between pool and disk
        scheduled_kv = SnapshotPrefixCache(self.kv, self.states) if self.states is not None else self.kv
        self.scheduler = Scheduler(config, scheduled_kv, slot_context=self.slot_context, eos_token_ids=eos_token_ids,
                                   drafts=self.drafts)
        self.memory_budget = MemoryBudget.of(  # spec O: checked at submit, before any forward pass
            num_blocks, config.block_size, bytes_per_token, config.request_memory_budget_bytes,
            max_live_tokens=config.max_kv_size + 2 * config.block_size if config.max_kv_size else 0,
            state_bytes=self.states.bytes_per_slot if self.states is not None else 0)
        mode = config.decode_step_mode(str(device))
        cache_dir = Path(config.compile_cache_dir) if config.compile_cache_dir else None
        taps = getattr(self.drafts.drafter, "feature_layers", ())  # a DFlash drafter reads target layers
        decode_step = DecodeStep(model, self.kv_cache, device, mode=mode, max_rows=_max_decode_rows(config),
                                 max_positions=max(shape.context_length, self.slot_context),
                                 max_keys=self.slot_context, cache_dir=cache_dir, taps=taps)
        runner_kind, extra = (Runner, {}) if self.states is None else (RecurrentRunner, {"states": self.states})
        self.runner = runner_kind(model, self.kv_cache, self.kv, device, decode_step,
                                  features=self.drafts.drafter.record if taps else None,
                                  prompt_logits=self.scheduler.record_prompt_logits, **extra)
        # On a GPU a step's events go out once the next step is launched, so the HTTP side turns
        # them into bytes while the device computes (the loop waits GIL-free); on the CPU at once
        # (there the step computes as it is called, and a late event would only add latency).
        self._defers_events = torch.device(device).type == "cuda" if defer_events is None else defer_events
        self._events: list[tuple[Sink, TokenEvent]] = []  # made, not yet handed to their sinks
        # issue 25: a core in its own process hands each flush over as one batch (engine/remote.py)
        self.flush_hook: Callable[[list[TokenEvent]], None] | None = None
        rows = model_lora_rows(model)
        self.lora_adapters = rows.paths if rows is not None else ()  # F8: slot files record them (F12)
        self.eos_token_ids = eos_token_ids
        self._penalty_counts = PenaltyCounts()  # the penalized requests' window counts, kept between steps
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="mlxcel-engine", daemon=True)
        self._stopping = threading.Event()
        self._num_pending = 0  # submitted but not yet seen by the loop
        self.failure: BaseException | None = None  # set when the loop thread died (health 503, exit 1)
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB, K %s, V %s), %d slots of %d tokens",
                 num_blocks, config.block_size, num_blocks * config.block_size * self.kv_cache.bytes_per_token / 2**20,
                 k_type, v_type, config.max_num_seqs, self.slot_context)
        if shape.num_shared_layers or shape.layer_shapes:
            log.info("KV cache: %d layers keep KV (heads x head size: %s); %d more reuse an earlier layer's "
                     "and keep none", shape.num_layers, _shape_counts(shape.layer_shapes), shape.num_shared_layers)

    def warm_decode_step(self) -> None:
        """Compile or capture the decode step now (startup), logging how long it took."""
        step = self.runner.decode_step
        log.info("decode step: %s; preparing it ...", step.mode)
        log.info("decode step ready (%s) in %.1f s", step.mode, step.warm())

    # ---- called from any thread ----

    def start(self) -> None:
        self._thread.start()

    def run_on_this_thread(self) -> None:
        """Run the loop on the calling thread until stop() (instead of start()).

        NOTE: OpenMP keeps one worker pool per thread that runs parallel regions; two pools on
        2 cores throttle each other's spin-waits, which slowed every decode step by ~50 %.
        A thread that loaded the model and then runs the loop keeps the process at one pool.
        """
        self.adopt_current_thread()
        self._run()

    def adopt_current_thread(self) -> None:
        """Make the calling thread the loop's thread (what stop() joins) before it runs the loop."""
        self._thread = threading.current_thread()

    def stop(self, timeout: float = 120.0) -> bool:
        """Abort everything in flight and join the loop thread; True when it exited in time."""
        self.request_stop()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def request_stop(self) -> None:
        """stop() without the join: the loop aborts what is in flight and returns."""
        self._stopping.set()
        self._inbox.put(("stop", None))

    @property
    def is_alive(self) -> bool:
        """False once the loop thread died of an error it could not contain."""
        return self.failure is None

    def submit(self, request: Request, sink: Sink) -> None:
        if self.failure is not None:
            raise EngineShutdownError("the engine stopped after an internal error; see the server log")
        if self._stopping.is_set():
            raise EngineShutdownError("the server is shutting down")
        admit(request, self.config, self.slot_context, self.memory_budget)
        with self._lock:
            # NOTE: a request still in the inbox is bound for a free slot as often as for the queue, so
            # admission counts all unfinished requests against slots + depth (never the timing of the loop).
            num_unfinished = len(self.scheduler.running) + len(self.scheduler.waiting) + self._num_pending
            if num_unfinished >= self.config.max_num_seqs + self.config.max_queue_depth:
                raise QueueFullError(f"the request queue is full ({self.config.max_queue_depth} waiting)")
            if self.failure is not None:  # checked again under the lock the dying loop takes
                raise EngineShutdownError("the engine stopped after an internal error; see the server log")
            self._num_pending += 1
            self._inbox.put(("add", (request, sink)))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the loop thread between steps (cache reset, slot save/restore)."""
        future: Future = Future()
        self._inbox.put(("call", (fn, future)))
        return future

    COMMANDS = frozenset({"save_slot", "restore_slot", "erase_slot", "reset_prefix_cache"})

    def command(self, name: str, *args: Any) -> Future:
        """`call` for one of COMMANDS by name: what a core in another process can be asked (issue 25)."""
        if name not in self.COMMANDS:
            raise ValueError(f"unknown engine command {name!r}")
        return self.call(lambda: getattr(self, name)(*args))

    def stats(self) -> EngineStats:
        with self._lock:
            s = self.scheduler
            slots = tuple(self._slot_stats(i) for i in range(self.config.max_num_seqs))
            return EngineStats(
                active_sequences=len(s.running), queue_depth=len(s.waiting) + self._num_pending,
                max_batch_size=self.config.max_num_seqs, sequences_started=s.num_started,
                sequences_completed=s.num_completed, sequences_aborted=s.num_aborted,
                tokens_generated=s.num_generated, is_alive=self.failure is None,
                prompt_tokens_processed=s.num_prompt_computed, context_size=self.slot_context,
                slots=slots, prefix_cache=self._prefix_cache_stats(), num_steps=s.num_steps,
                num_busy_slot_steps=s.num_busy_slot_steps, max_sequence_len=s.max_sequence_len,
                drafts=self._draft_stats(), recurrent_state=self.states.stats() if self.states is not None else None)

    def _prefix_cache_stats(self) -> PrefixCacheStats:
        stats = self.kv.stats()
        return replace(stats, disk=self.disk.stats() if self.disk is not None else None,
                       host=self.host.stats() if self.host is not None else None)

    def _draft_stats(self) -> DraftStats:
        spec, drafts = self.config.speculative, self.drafts
        if drafts.kind == "none":
            return DraftStats()
        return DraftStats(kind=drafts.kind, draft_max=spec.draft_max, draft_min=spec.draft_min,
                          max_batch=spec.max_batch, draft_model=spec.draft_model,
                          num_drafted=drafts.num_drafted, num_accepted=drafts.num_accepted,
                          num_rounds=drafts.num_rounds)

    def _slot_stats(self, slot_id: int) -> SlotStats:
        seq = next((q for q in self.scheduler.running if q.slot_id == slot_id), None)
        return SlotStats(slot_id=slot_id, is_processing=seq is not None,
                         request_id=seq.request_id if seq else None,
                         num_prompt_tokens=seq.num_prompt_tokens if seq else 0,
                         num_generated_tokens=seq.num_output_tokens if seq else 0,
                         context_size=self.slot_context, num_remaining_tokens=_remaining(seq),
                         num_cached_tokens=seq.num_cached_tokens if seq else 0, **self._slot_state(seq))

    def _slot_state(self, seq: Sequence | None) -> dict[str, int]:
        """Issue 41: a hybrid model's recurrent state of a slot (its bytes are held whether it runs or not)."""
        if self.states is None:
            return {}
        return {"num_state_bytes": self.states.slot_bytes(),
                "num_state_snapshots": self.states.num_snapshots_of(seq.request_id) if seq else 0}

    # ---- slot snapshots (F12); run these on the loop thread through `call` ----

    def save_slot(self, slot_id: int, filename: str) -> slot_files.SlotFileResult:
        path = slot_files.slot_file(self.config.slot_save_path, filename)
        content = self._slot_content(slot_id)
        return slot_files.save_slot(self.kv, self.kv_cache, content, self.lora_adapters, slot_id, path, self.states)

    def restore_slot(self, slot_id: int, filename: str) -> slot_files.SlotFileResult:
        path = slot_files.slot_file(self.config.slot_save_path, filename)
        self._slot_content(slot_id, must_exist=False)
        result, content = slot_files.restore_slot(self.kv, self.kv_cache, slot_id, path, self.lora_adapters,
                                                  self.states)
        self.scheduler.slot_contents[slot_id] = content
        return result

    def erase_slot(self, slot_id: int) -> int:
        content = self._slot_content(slot_id, must_exist=False)
        self.scheduler.slot_contents.pop(slot_id, None)
        return slot_files.erase_slot(self.kv, content) if content.token_ids else 0

    def reset_prefix_cache(self) -> PrefixCacheReset:
        """POST /v1/cache/reset (F7) on the loop thread: every tier drops what it caches, so a reset prompt
        is cold again, after a restart too (issue 29). Blocks in use keep their hashes until freed."""
        num_blocks = self.kv.pool.num_cached_blocks
        if not self.kv.reset():
            return PrefixCacheReset(is_reset=False)
        if self.states is not None:  # issue 41: the recurrent-state snapshots, in RAM and on disk
            self.states.reset()
        num_host = self.host.reset() if self.host is not None else 0
        num_files, num_bytes = self.disk.reset() if self.disk is not None else (0, 0)
        return PrefixCacheReset(is_reset=True, num_blocks=num_blocks, num_host_blocks=num_host,
                                num_disk_files=num_files, num_disk_bytes=num_bytes)

    def _slot_content(self, slot_id: int, must_exist: bool = True) -> SlotContent:
        if not 0 <= slot_id < self.config.max_num_seqs:
            raise slot_files.SlotError(f"slot id {slot_id} is out of range (0..{self.config.max_num_seqs - 1})")
        if any(s.slot_id == slot_id for s in self.scheduler.running):
            raise slot_files.SlotError(f"slot {slot_id} is busy")
        content = self.scheduler.slot_contents.get(slot_id, SlotContent([]))
        if must_exist and not content.token_ids:
            raise slot_files.SlotError(f"slot {slot_id} has no cached prompt to save")
        return content

    # ---- the loop thread ----

    def _run(self) -> None:
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - recorded: /health turns 503 and the server exits 1
            with self._lock:
                self.failure = exc
            log.critical("the engine loop died: %r; failing every request", exc, exc_info=exc)
            self._fail_all()

    def _loop(self) -> None:
        while True:
            self._drain_inbox(block=not self.scheduler.has_work)
            if self._stopping.is_set():
                self._abort_all()
                if self.host is not None:  # issue 29 point 5: host blocks first, the older ones
                    self.host.close()
                if self.disk is not None:  # issue 29: every block still cached goes to disk
                    self.disk.close(self.kv.pool)
                if self.states is not None:  # issue 41: and the recurrent-state snapshots beside them
                    self.states.save_all()
                return
            if self.scheduler.has_work:
                self._step()

    def _drain_inbox(self, block: bool) -> None:
        if block:
            self._flush_events()
        try:
            command = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        self._flush_events()  # an abort or a call sees every event made before it
        while True:
            self._handle(*command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            self._add(*payload)
        elif kind == "abort":
            self._abort(payload)
        elif kind == "call":
            fn, future = payload
            try:
                future.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - handed back to the caller
                future.set_exception(exc)

    def _add(self, request: Request, sink: Sink) -> None:
        with self._lock:
            self._num_pending -= 1
            try:
                self.scheduler.add_request(request)
            except Exception:  # noqa: BLE001 - one bad request must not kill the loop
                log.exception("request %s could not be added; failing it", request.request_id)
                sink(_error_event(request.request_id))
                return
            self._sinks[request.request_id] = sink

    def _abort(self, request_id: str) -> None:
        with self._lock:
            seq = self.scheduler.abort(request_id)
        sink = self._sinks.pop(request_id, None)
        if seq is not None and sink is not None:
            sink(TokenEvent(request_id, (), finish_reason=FinishReason.ABORT,
                            num_prompt_tokens=seq.num_prompt_tokens))

    def _abort_all(self) -> None:
        self._flush_events()
        for request_id in list(self._sinks):
            self._abort(request_id)

    def _step(self) -> None:
        with self._lock:
            out = self.scheduler.schedule()
        if not out.scheduled:
            self._drain_inbox(block=True)  # nothing fits now; wait for an abort or a finish
            return
        self.scheduler.attach_drafts(out)
        reporting = _reporting_progress(out)
        self._queue_progress([s for s in reporting if s.num_computed_tokens == s.num_cached_tokens])  # the 0 % event
        self._hand_over()
        self.kv.pool.flush_evictions()  # the prefix cache's tiers gather this step's evicted blocks before it writes
        try:
            results = self._forward_and_sample(out)
        except Exception:  # noqa: BLE001 - one bad step must not kill the server
            log.exception("engine step failed; failing its %d requests", len(out.scheduled))
            self._flush_events()
            self._fail(out)
            return
        self._queue_progress(reporting)
        self._queue_results(results)
        self._hand_over()

    def _forward_and_sample(self, out: SchedulerOutput) -> list[StepResult]:
        step = self.runner.execute(out)  # on a GPU: launched; the sampler's read waits for it
        self._flush_events()  # the previous step's, while this one computes
        request_ids, logits = step.request_ids, step.logits
        by_id = {s.seq.request_id: s.seq for s in out.scheduled}
        rows = [self._sampling_row(by_id[r]) for r in request_ids]
        try:
            tokens, logprobs = sample(logits, rows, self._penalty_counts) if rows else ([], [])
            sampled = {r: (t, lp) for r, t, lp in zip(request_ids, tokens, logprobs)}
        except Exception:  # noqa: BLE001 - find the bad row(s) and fail only those
            sampled = self._sample_rows_apart(request_ids, logits, rows)
        with self._lock:
            results = self.scheduler.update_from_output(out, sampled)
            failed = self.scheduler.take_failed()
        for request_id in failed:  # issue 44: a row whose token could not be taken fails alone
            self._fail_request(request_id)
        return results + self._accept_drafts(out, step)

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        return SamplingRow(seq.request.sampling, seq.token_ids, seq.num_output_tokens, self.eos_token_ids,
                           seq.generator, seq.request.processors, owner=seq.request_id)

    def _accept_drafts(self, out: SchedulerOutput, step: StepLogits) -> list[StepResult]:
        """Verify rows (B4): the target's sampler picks each position's token in turn."""
        results: list[StepResult] = []
        for item in (s for s in out.scheduled if s.draft):
            try:
                with self._lock:
                    result = self.scheduler.update_verified(item, self._chooser(item, step.verify[item.seq.request_id]))
            except Exception:  # noqa: BLE001 - logged; the other rows keep going
                log.exception("verifying the draft of request %s failed; failing it", item.seq.request_id)
                self._fail_request(item.seq.request_id)
                continue
            if result is not None:
                results.append(result)
        return results

    def _chooser(self, item: ScheduledSeq, logits: torch.Tensor) -> ChooseToken:
        def choose(i: int) -> tuple[int, Any]:
            tokens, logprobs = sample(logits[i:i + 1], [self._sampling_row(item.seq)], self._penalty_counts)
            return tokens[0], logprobs[0]
        return choose

    def _sample_rows_apart(self, request_ids: list[str], logits: torch.Tensor,
                           rows: list[SamplingRow]) -> dict[str, tuple[int, Any]]:
        """Sample row by row; a row whose sampling raises fails its request alone."""
        sampled: dict[str, tuple[int, Any]] = {}
        for i, (request_id, row) in enumerate(zip(request_ids, rows)):
            try:
                tokens, logprobs = sample(logits[i:i + 1], [row], self._penalty_counts)
                sampled[request_id] = (tokens[0], logprobs[0])
            except Exception:  # noqa: BLE001 - logged; the other rows keep going
                log.exception("sampling failed for request %s; failing it", request_id)
                self._fail_request(request_id)
        return sampled

    def _queue_progress(self, seqs: list[Sequence]) -> None:
        """A PromptProgress event for each sequence that asked for one: before its first prefill chunk
        (processed == cache, llama-server's "0 %" update) and after each chunk, before the step's tokens."""
        now = time.monotonic()
        for seq in seqs:
            sink = self._sinks.get(seq.request_id)
            if sink is None:
                continue
            started = seq.prefill_start_time if seq.prefill_start_time is not None else now
            progress = PromptProgress(total=seq.num_prompt_tokens, cache=seq.num_cached_tokens,
                                      processed=min(seq.num_computed_tokens, seq.num_prompt_tokens),
                                      time_ms=int((now - started) * 1000))
            self._events.append((sink, TokenEvent(seq.request_id, (), num_prompt_tokens=seq.num_prompt_tokens,
                                                  num_cached_tokens=seq.num_cached_tokens, progress=progress)))

    def _queue_results(self, results: list[StepResult]) -> None:
        for r in results:
            seq = r.seq
            sink = self._sinks.get(seq.request_id)
            if r.finish_reason is not None:
                self._sinks.pop(seq.request_id, None)
                log_finished(seq, r.finish_reason)
                if self.disk is not None:
                    _observe_prefill(self.disk, seq)
            if sink is not None:
                self._events.append((sink, TokenEvent(seq.request_id, r.token_ids, r.logprobs, r.finish_reason,
                                                      num_prompt_tokens=seq.num_prompt_tokens,
                                                      num_cached_tokens=seq.num_cached_tokens,
                                                      num_drafted=seq.num_drafted,
                                                      num_draft_accepted=seq.num_draft_accepted,
                                                      prompt_logprobs=r.prompt_logprobs)))

    def _hand_over(self) -> None:
        """Events just made go out now on the CPU; on a GPU they wait for the next step's launch."""
        if not self._defers_events:
            self._flush_events()

    def _flush_events(self) -> None:
        events, self._events = self._events, []
        hook = self.flush_hook
        if hook is not None:
            if events:
                hook([event for _, event in events])
            return
        for sink, event in events:
            try:
                sink(event)
            except Exception:  # noqa: BLE001 - issue 44: one request's bad hand-over fails it alone
                log.exception("handing an event of request %s over failed; failing it", event.request_id)
                if event.finish_reason is None:
                    self._fail_request(event.request_id)

    def _fail(self, out: SchedulerOutput) -> None:
        for item in out.scheduled:
            self._fail_request(item.seq.request_id)

    def _fail_request(self, request_id: str) -> None:
        with self._lock:
            self.scheduler.abort(request_id)
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            try:
                sink(_error_event(request_id))
            except Exception:  # noqa: BLE001 - its sink is what broke: nothing more can reach it
                log.exception("the error event of request %s could not be handed over", request_id)

    def _fail_all(self) -> None:
        """The loop is dying: every request still known or still in the inbox gets an error event."""
        try:
            self._flush_events()
        except Exception:  # noqa: BLE001 - a broken sink must not keep the rest unanswered
            log.exception("handing over the last events failed")
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                payload[1](_error_event(payload[0].request_id))
            elif kind == "call":
                payload[1].set_exception(EngineShutdownError("the engine stopped"))
        for request_id in list(self._sinks):
            try:
                self._fail_request(request_id)
            except Exception:  # noqa: BLE001 - the state may be broken; still answer the rest
                sink = self._sinks.pop(request_id, None)
                if sink is not None:
                    sink(_error_event(request_id))


def admit(request: Request, config: EngineConfig, slot_context: int, budget: MemoryBudget) -> None:
    """The checks and defaults of a submit, before the request reaches the loop: context overflow, an
    empty prompt, the server's defaults, max_tokens clamped to the context, the memory budget (spec O)."""
    if len(request.prompt_token_ids) >= slot_context and not config.max_kv_size:
        raise ContextOverflowError(len(request.prompt_token_ids), slot_context)
    if not request.prompt_token_ids:
        raise ValueError("the prompt is empty: at least one token is needed")
    _apply_server_defaults(request, config)
    _clamp_max_tokens(request, config, slot_context)
    _check_memory(request, slot_context, budget)


def _apply_server_defaults(request: Request, config: EngineConfig) -> None:
    """--n-predict fills a missing max_tokens and --seed a missing seed, as llama-server's -n and -s do
    ("the per-request limit takes priority over the global one")."""
    sampling, default = request.sampling, config.n_predict
    if default > 0 and sampling.max_tokens is None:
        sampling = replace(sampling, max_tokens=default)
    if config.seed >= 0 and sampling.seed is None:
        sampling = replace(sampling, seed=config.seed)
    request.sampling = sampling


def _clamp_max_tokens(request: Request, config: EngineConfig, slot_context: int) -> None:
    """max_tokens past the slot's context is cut to what fits, as llama-server does, and logged."""
    if config.max_kv_size:
        return  # a sliding window keeps going past the context
    room = slot_context - len(request.prompt_token_ids)
    wanted = request.sampling.max_tokens
    if wanted is not None and wanted > room:
        log.info("request %s: max_tokens %d clamped to %d (context %d, prompt %d tokens)",
                 request.request_id, wanted, room, slot_context, len(request.prompt_token_ids))
        request.sampling = replace(request.sampling, max_tokens=room)


def _check_memory(request: Request, slot_context: int, budget: MemoryBudget) -> None:
    """Spec O: the prompt plus the planned output must fit the request memory budget."""
    num_prompt = len(request.prompt_token_ids)
    planned = request.sampling.max_tokens
    num_output = planned if planned is not None else max(slot_context - num_prompt, 0)
    budget.check(request.request_id, num_prompt, num_output)


DEFAULT_DISK_BYTES = 20 * 2**30  # --prefix-cache-disk-size auto on the CPU


def _open_disk_tier(config: EngineConfig, cache: KVCache, kv: KVCacheManager, identity: str) -> DiskBlockStore | None:
    """The prefix cache's disk tier (issue 29) when asked for and prefix caching is on; None otherwise."""
    capacity = config.prefix_cache_disk_bytes
    if capacity < 0:  # auto: on the CPU only (an H200 recomputed a prompt faster than it loaded it from disk)
        capacity = DEFAULT_DISK_BYTES if cache.k[0].device.type == "cpu" else 0
    if not (config.prefix_cache_dir and capacity > 0 and kv.is_enabled):
        return None
    if not identity:  # NOTE: without the model's identity, KV of another model could be read back
        log.warning("disk prefix cache: off (no KV identity: the engine was built without a model file)")
        return None
    key = f"{identity}|K {cache.k_type}|V {cache.v_type}|block {cache.block_size}|step {config.decode_step}|v1"
    tier = DiskTierConfig(Path(config.prefix_cache_dir).expanduser(), capacity,
                          hashlib.sha256(key.encode()).hexdigest())
    try:
        store = open_disk_tier(tier, cache, kv.pool)
    except OSError as exc:  # an unusable folder costs the disk tier, never the server
        log.warning("disk prefix cache: %s cannot be used (%s); caching in RAM only", tier.directory, exc)
        return None
    kv.lower_tier = store
    return store


def _open_host_tier(config: EngineConfig, cache: KVCache, kv: KVCacheManager,
                    disk: DiskBlockStore | None) -> HostBlockTier | None:
    """The host-memory tier (issue 29 point 5): on by default on CUDA, by --prefix-cache-host-size anywhere."""
    capacity = config.prefix_cache_host_bytes
    if capacity < 0:
        capacity = default_host_bytes(cache.k[0].device)
    if capacity <= 0 or not kv.is_enabled:
        return None
    host = open_host_tier(capacity, cache, kv.pool, disk)
    if host is not None:
        kv.lower_tier = host  # it asks the disk tier for what it does not hold
    return host


def _observe_prefill(disk: DiskBlockStore, seq: Sequence) -> None:
    """A finished request's prompt rate, for the disk tier's load-or-recompute choice."""
    if seq.num_preemptions or seq.first_token_time is None or seq.prefill_start_time is None:
        return
    disk.observe_prefill(seq.num_prompt_tokens - seq.num_cached_tokens, seq.first_token_time - seq.prefill_start_time)


def _max_decode_rows(config: EngineConfig) -> int:
    """Decode-step rows a step may hold: one per slot, plus each speculating row's draft positions (B4)."""
    spec = config.speculative
    extra = min(spec.max_batch, config.max_num_seqs) * spec.draft_max if spec.is_enabled else 0
    return config.max_num_seqs + extra


def _reporting_progress(out: SchedulerOutput) -> list[Sequence]:
    """The step's rows that compute a prompt chunk for a request with report_progress.

    NOTE: a preempted sequence's recomputation is left out: its client already saw processed ==
    total, and llama-server, which never preempts, has no progress that goes back."""
    return [item.seq for item in out.scheduled
            if item.seq.request.report_progress and item.seq.num_preemptions == 0
            and item.seq.num_computed_tokens < item.seq.num_prompt_tokens]


def _error_event(request_id: str) -> TokenEvent:
    return TokenEvent(request_id, (), finish_reason=FinishReason.ERROR,
                      error="internal engine error; see the server log")


def log_finished(seq: Sequence, reason: FinishReason) -> None:
    """One line per finished request: sizes, cache reuse and speeds (as llama-server's timings)."""
    now = time.monotonic()
    first = seq.first_token_time or now
    prefill_s = max(first - seq.request.arrival_time, 1e-9)
    decode_s = max(now - first, 1e-9)
    num_out = seq.num_output_tokens
    drafts = (f"; draft tokens accepted {seq.num_draft_accepted}/{seq.num_drafted} "
              f"({100 * seq.num_draft_accepted / seq.num_drafted:.0f} %)" if seq.num_drafted else "")
    log.info("request %s finished (%s): prompt %d tokens (%d cached), time to first token %.0f ms; "
             "generated %d tokens, %.1f tok/s%s", seq.request_id, reason.value, seq.num_prompt_tokens,
             seq.num_cached_tokens, prefill_s * 1000, num_out,
             (num_out - 1) / decode_s if num_out > 1 else 0.0, drafts)


def _remaining(seq: Sequence | None) -> int:
    """Tokens a running sequence may still generate (llama-server's n_remain); -1 when idle or unbounded."""
    if seq is None or seq.request.sampling.max_tokens is None:
        return -1
    return max(seq.request.sampling.max_tokens - seq.num_output_tokens, 0)


# Prefix snapshots of recurrent state a slot may keep (issue 41): each is one sequence's whole state.
SNAPSHOTS_PER_SLOT = 4


def _state_pool(model: torch.nn.Module, config: EngineConfig, dtype: torch.dtype,
                device: torch.device | str, *, drafts: DraftPolicy) -> StatePool | None:
    """The recurrent-state pool of a hybrid model (None for attention-only models); verify slots where
    any drafter drafts (a --draft-kind, or the checkpoint's own MTP layers under `--draft-kind none`)."""
    specs = state_specs(model)
    if not specs:
        return None
    num_snapshots = SNAPSHOTS_PER_SLOT * config.max_num_seqs if config.enable_prefix_caching else 0
    verify_width = config.speculative.draft_max + 1 if drafts.drafter.kind != "none" else 0
    pool = StatePool(specs, num_seqs=config.max_num_seqs, num_snapshots=num_snapshots, verify_width=verify_width,
                     block_size=config.block_size, dtype=dtype, device=device)
    log.info("recurrent state: %d layers, %.2f MiB a sequence; %d slots (%d live, %d verify, %d prefix snapshots), "
             "%.1f MiB", len(specs), pool.bytes_per_slot / 2**20, pool.tensors.num_slots, config.max_num_seqs,
             config.max_num_seqs * verify_width, num_snapshots, pool.num_bytes / 2**20)
    return pool

