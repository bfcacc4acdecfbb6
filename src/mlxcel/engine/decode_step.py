"""The decode step: one new token for each of B single-token rows, as one traced function.

Its inputs are six tensors (token ids, positions, the slot each new key goes to, each row's
live key slots and their positions, its LoRA scales), so the step traces whole:
- `eager`: the reference path, the same function run op by op (`--no-compile`);
- `native` (CPU): the decoder layers in one C++ call (engine/native_step.py) where the model
  has a Llama/Qwen2 layout with packed weights, else `compile`;
- `compile`: torch.compile with inductor (CPU): one decoder layer compiled once and shared
  by every layer, batch and key lengths symbolic, plus the output head compiled on its own;
  compiled code is kept in a persistent cache on disk;
- `cuda-graph`: the same compiled layer (Triton), then one CUDA graph of the whole step per
  (rows, keys) bucket, captured at startup over static buffers and replayed after copying a
  batch into them; padding rows write only the cache's scratch slot.
Prefill chunks stay on the model's eager path (engine/runner.py).

A model that cannot be stepped layer by layer (`can_step_layers` False: the transformers fallback,
models/_transformers.py, whose layers are transformers' own) runs whole and eagerly in every mode,
its attention calls going to each layer's `DecodeAttention` (`StepDecodeAttention`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mlxcel.engine import native_step
from mlxcel.engine.kv.tensors import KVCache
from mlxcel.engine.native_step import NativeLayers
from mlxcel.engine.sampler import on_device
from mlxcel.layers.attention import DecodeAttention
from mlxcel.layers.lora import model_lora_rows
from mlxcel.layers.recurrent import SCRATCH_SLOT, RecurrentStates, StateTensors, state_specs

log = logging.getLogger(__name__)

KEY_ALIGN = 64  # each row's keys are padded to a multiple of this (fixed reduction shapes)
STEP_MODES = ("eager", "native", "compile", "cuda-graph")


@dataclass(frozen=True, slots=True)
class DecodeRow:
    """One single-token row: its token at `position`, attending over positions kv_start..position."""

    token_id: int
    position: int
    kv_start: int
    block_table: tuple[int, ...]
    lora_scales: tuple[float, ...] = ()  # F8: this row's adapter scales; () = none (all 0)
    writes_kv: bool = True  # False: the key at `position` is already cached (a prefix-cache hit); write scratch
    rope_offset: int = 0  # issue 43: M-RoPE's rotary position is position + this (a model's query position too)
    state_read: int = 0  # hybrid models: the recurrent-state slots this row reads and writes (engine/kv/states.py)
    state_write: int = 0


@dataclass(slots=True)
class DecodeInputs:
    """The step's tensors: [B] ids, positions and new-key slots; [B, L] key slots and positions;
    [B, num_adapters] LoRA scales (an input of the step, so rows may differ: F8)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    key_slots: torch.Tensor
    key_pos: torch.Tensor
    lora_scales: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.input_ids, self.positions, self.slot_mapping, self.key_slots, self.key_pos, self.lora_scales


def build_inputs(rows: list[DecodeRow], block_size: int, scratch_slot: int, *, num_rows: int | None = None,
                 num_keys: int | None = None, num_adapters: int = 0,
                 device: torch.device | str = "cpu") -> DecodeInputs:
    """The step's input tensors for `rows` on `device`, padded to `num_rows` rows and `num_keys` keys
    (default: just enough).

    Built for the whole batch at once (a handful of tensor ops, not a few per row: at 64 rows the
    per-row version cost ~2 ms a step, longer than the GPU's step). Only the per-row values cross from
    the host (copies that do not wait for the device's queue); the [rows, keys] slot and position maps
    are expanded on `device`: on the host they took most of the engine process's time at 256 rows
    (py-spy on an H200, issue 25)."""
    num_rows = num_rows or len(rows)
    count = len(rows)
    num_keys = num_keys or -(-max(r.position + 1 - r.kv_start for r in rows) // KEY_ALIGN) * KEY_ALIGN
    width = max(len(r.block_table) for r in rows)
    tables = on_device([r.block_table + (0,) * (width - len(r.block_table)) for r in rows], torch.long, device)
    starts = on_device([r.kv_start for r in rows], torch.long, device)
    last = on_device([r.position for r in rows], torch.long, device)
    pos = starts.unsqueeze(1) + torch.arange(num_keys, device=device).unsqueeze(0)  # [rows, keys]
    live = pos <= last.unsqueeze(1)
    blocks = tables.gather(1, pos.div(block_size, rounding_mode="floor").clamp(max=width - 1))  # past the end: masked
    key_slots = torch.full((num_rows, num_keys), scratch_slot, dtype=torch.long, device=device)
    key_pos = torch.full((num_rows, num_keys), -1, dtype=torch.long, device=device)
    key_slots[:count] = torch.where(live, blocks * block_size + pos.remainder(block_size), scratch_slot)
    key_pos[:count] = torch.where(live, pos, -1)
    ids = torch.zeros(num_rows, dtype=torch.long, device=device)
    positions = torch.zeros(num_rows, dtype=torch.long, device=device)
    slots = torch.full((num_rows,), scratch_slot, dtype=torch.long, device=device)
    ids[:count] = on_device([r.token_id for r in rows], torch.long, device)
    positions[:count] = last
    if any(r.rope_offset for r in rows):  # M-RoPE (issue 43): the rotary's position; slots stay the cache's
        positions[:count] += on_device([r.rope_offset for r in rows], torch.long, device)
    slots[:count] = (tables.gather(1, last.div(block_size, rounding_mode="floor").unsqueeze(1)).squeeze(1) * block_size
                     + last.remainder(block_size))
    if not all(r.writes_kv for r in rows):
        writes = on_device([r.writes_kv for r in rows], torch.bool, device)
        slots[:count] = torch.where(writes, slots[:count], scratch_slot)
    lora = torch.zeros(num_rows, num_adapters, device=device)  # padding rows and rows without scales: the base model
    if any(r.lora_scales for r in rows):
        lora[:count] = on_device([r.lora_scales or (0.0,) * num_adapters for r in rows], torch.float32, device)
    return DecodeInputs(ids, positions, slots, key_slots, key_pos, lora)


class DecodeStep:
    """Runs decode rows through the model and its output head; called on the engine thread only."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device | str, *,
                 mode: str, max_rows: int, max_positions: int, max_keys: int | None = None,
                 cache_dir: Path | None = None, taps: tuple[int, ...] = ()) -> None:
        """`taps`: decoder layers whose outputs each step keeps in `tapped` (a DFlash drafter's
        target features, engine/spec/dflash.py), concatenated in this order."""
        if mode not in STEP_MODES:
            raise ValueError(f"decode step mode must be one of {', '.join(STEP_MODES)}; not {mode!r}")
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.mode = mode
        self.max_rows = max_rows
        self.max_positions = max_positions
        self.lora_rows = model_lora_rows(model)
        self.num_adapters = self.lora_rows.num_adapters if self.lora_rows is not None else 0
        for rotary in _rotaries(model):
            rotary.ensure_positions(max_positions)
        self._layer: Callable[..., torch.Tensor] = run_layer
        self._head: Callable[[torch.Tensor], torch.Tensor] = model.compute_logits
        self._native: list[tuple[int, NativeLayers]] | None = None  # (last layer, its call)
        self.taps = tuple(taps)
        self.tapped: torch.Tensor | None = None  # [rows, len(taps) x hidden] of the last run, when taps
        self.is_whole_model = not getattr(model, "can_step_layers", True)
        # Hybrid models: the recurrent layers' states (set by the engine), handed to each layer per step.
        self.states: StateTensors | None = None
        self._step_states: RecurrentStates | None = None
        self.is_hybrid = bool(state_specs(model))
        if self.is_hybrid and mode in ("native", "compile"):
            log.info("decode step: eager, not %s: the model has recurrent layers (issue 41: their compiled CPU "
                     "step is not written yet)", mode)
            self.mode = mode = "eager"
        if self.is_whole_model:
            if self.taps:
                raise ValueError("this model runs whole (transformers' own modeling code): a drafter cannot read "
                                 "its layers' hidden states")
            if mode != "eager":
                log.info("decode step: eager, not %s: the model runs whole (transformers' own modeling code, "
                         "no decoder layers of ours to compile or capture)", mode)
            self.mode = mode = "eager"
        if mode == "native":
            reason = native_step.unsupported(model, kv_cache, has_lora=self.lora_rows is not None)
            if reason is not None or self.device.type != "cpu":
                log.info("decode step: native layers do not take this model (%s); compiling it instead",
                         reason or f"they run on the CPU, not {self.device}")
                self.mode = mode = "compile"
        if mode == "cuda-graph" and self.taps:
            log.info("decode step: eager, not CUDA graphs: the drafter reads hidden states of layers %s",
                     list(self.taps))
            self.mode = mode = "eager"
        if mode == "compile" or (mode == "cuda-graph" and not self.is_hybrid):
            # A hybrid's layers are captured as they run eagerly (issue 41): one graph of the whole step
            # removes the launches that bound it; the recurrent layers are not compiled.
            self._layer = compile_layer(cache_dir)
        if mode == "compile":
            self._head = compile_head(model.compute_logits)
        self._graphs = CudaGraphs(self, max_rows, max_keys or max_positions) if mode == "cuda-graph" else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                key_slots: torch.Tensor, key_pos: torch.Tensor, lora_scales: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] for the rows' next tokens (writes their KV): the family's embedding,
        its decoder layers one by one (`_layer`: compiled once, shared by every layer), final
        norm and output head (`_head`: on CPU compiled on its own with frozen weights)."""
        if self.is_whole_model:
            step = StepDecodeAttention(self.kv_cache, slot_mapping, key_slots, key_pos, positions)
            return self._head(self.model(input_ids, positions, step))
        inner = self.model.model
        outputs: dict[int, torch.Tensor] = {}  # tapped layer -> its output
        if self.mode == "native":
            if self._native is None:  # collected on first use: lazy weights are loaded by then
                self._native = [(part[-1], NativeLayers(self.model, self.kv_cache, part))
                                for part in _split_after(len(inner.layers), self.taps)]
            x = inner.embed(input_ids)
            for last, layers in self._native:  # the whole stack in one call, or cut after each tapped layer
                x = outputs[last] = layers(x, positions, slot_mapping, key_slots, key_pos)
        else:
            if self.lora_rows is not None:  # read by the (compiled) layers as an input, not a constant
                self.lora_rows.set_rows(lora_scales)
            x = inner.embed(input_ids)
            for index, layer in enumerate(inner.layers):
                kv_index = getattr(layer, "kv_index", index)  # a recurrent layer (None) reads no KV: any layer's
                ctx = self.kv_cache.decode_attention(kv_index or 0, slot_mapping, key_slots, key_pos, positions)
                ctx.states = self._step_states
                x = outputs[index] = self._layer(layer, x, positions, ctx)
        if self.taps:
            self.tapped = torch.cat([outputs[i] for i in self.taps], dim=-1)
        return self._head(inner.norm(x))

    @torch.inference_mode()
    def run(self, rows: list[DecodeRow]) -> torch.Tensor:
        """Logits [len(rows), vocab], float32 on the step's device (the sampler moves what it needs).

        NOTE: under CUDA graphs they may be a view of the graph's output buffer: read them before
        the next step."""
        self._materialize_lazy_weights()
        if self._graphs is not None:
            return self._graphs.run(rows)
        # NOTE: compiled, a batch of one would take a graph specialised for size 1, whose sums
        # are ordered differently; a padding row keeps every batch on the one symbolic graph.
        num_rows = max(len(rows), 2) if self.mode == "compile" else len(rows)
        self._step_states = self.step_states(rows, num_rows)
        inputs = build_inputs(rows, self.kv_cache.block_size, self.kv_cache.scratch_slot, num_rows=num_rows,
                              num_adapters=self.num_adapters, device=self.device)
        logits = self.forward(*inputs.tensors())
        return logits[:len(rows)].float()

    def step_states(self, rows: list[DecodeRow], num_rows: int) -> RecurrentStates | None:
        """Hybrid models: the step's recurrent-state view, `rows`' state slots then padding rows' scratch slot."""
        if self.states is None:
            return None
        padding = [SCRATCH_SLOT] * (num_rows - len(rows))
        # Copied without waiting for the device's queue (a replay may still run), as build_inputs' tensors.
        reads = on_device([r.state_read for r in rows] + padding, torch.long, self.device)
        return RecurrentStates.decode(self.states, reads,
                                      on_device([r.state_write for r in rows] + padding, torch.long, self.device))

    @torch.inference_mode()  # as run(): a capture must not trace autograd (the attention op has none)
    def warm(self, num_positions: int = 100) -> float:
        """Run (and so compile or capture) the step on scratch rows; returns the seconds it took."""
        started = time.monotonic()
        self._materialize_lazy_weights()
        if self._graphs is not None:
            self._graphs.capture_all()
        else:
            self.run([self._scratch_row(num_positions)] * min(2, self.max_rows))
            self.run([self._scratch_row(num_positions)] * min(3, self.max_rows))  # and a batch of another size
        return time.monotonic() - started

    def _materialize_lazy_weights(self) -> None:
        # A6 lazy weights load in forward pre-hooks, which a compiled or captured step cannot run.
        lazy = getattr(self.model, "lazy_weights", None)
        if lazy is not None and lazy.num_pending and self.mode != "eager":
            log.info("lazy weights: reading the %d modules still pending for the %s decode step", lazy.num_pending,
                     self.mode)
            lazy.materialize_all()

    def _scratch_row(self, num_positions: int) -> DecodeRow:
        # Every key of a scratch row lives in the scratch slot: the warmup writes no real block.
        num_positions = min(num_positions, self.max_positions)
        scratch_block = self.kv_cache.scratch_slot // self.kv_cache.block_size
        return DecodeRow(0, num_positions - 1, 0, (scratch_block,) * (num_positions // self.kv_cache.block_size + 1))


class StepDecodeAttention:
    """The decode step's attention for a model run whole: each layer's `attend` goes to that layer's
    `DecodeAttention` (the same tensors and kernels a layer-by-layer step uses)."""

    def __init__(self, kv_cache: KVCache, slot_mapping: torch.Tensor, key_slots: torch.Tensor,
                 key_pos: torch.Tensor, q_pos: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self.inputs = (slot_mapping, key_slots, key_pos, q_pos)

    def num_decode_rows(self, num_rows: int) -> int:
        """Every row is a decode row (see `AttentionContext.num_decode_rows`)."""
        return num_rows

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               scale: float, window: int | None = None) -> torch.Tensor:
        """q: [B, Hq, D], k/v: [B, Hkv, D] of layer `layer` -> [B, Hq, D]."""
        return self.kv_cache.decode_attention(layer, *self.inputs).attend(layer, q, k, v, scale=scale, window=window)


def _split_after(num_layers: int, taps: tuple[int, ...]) -> list[range]:
    """Layer ranges that end at each tapped layer and at the last: [0, t0], [t0 + 1, t1], ..."""
    ends = sorted({*taps, num_layers - 1})
    return [range(start, end + 1) for start, end in zip([0, *(e + 1 for e in ends)], ends)]


def _rotaries(model: torch.nn.Module) -> list:
    from mlxcel.layers.rope import RotaryEmbedding

    return [m for m in model.modules() if isinstance(m, RotaryEmbedding)]


# ---- CPU: torch.compile ----

def run_layer(layer: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor, ctx: DecodeAttention) -> torch.Tensor:
    return layer(x, positions, ctx)


def compile_layer(cache_dir: Path | None) -> Callable[..., torch.Tensor]:
    """`run_layer` through torch.compile (inductor), batch and key lengths symbolic.

    Compiled per layer, not per model: the decoder layers share code and shapes, so one
    compilation (weights and cache tensors as inputs) serves all of them, and compile time is
    that of one layer. Inductor keeps compiled kernels in `cache_dir` (FX graph and AOT
    autograd caches), so a restart with the same model, torch and options re-traces only.
    """
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
        inductor_config.fx_graph_cache = True
    dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 16)
    return torch.compile(run_layer, fullgraph=True, dynamic=True)


def compile_head(head: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The output head compiled with frozen weights and max-autotune: inductor's C++ GEMM template
    reads the vocabulary-wide int8 weight about 3x faster than the aten kernel (PERF.md)."""
    return torch.compile(head, fullgraph=True, dynamic=True,
                         options={"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"})


# ---- GPU: CUDA graphs ----

class CudaGraphs:
    """One captured decode step per (rows, keys) bucket, replayed over static buffers.

    A hybrid model's step (issue 41) is captured with a static `RecurrentStates` per bucket: the recurrent
    layers gather their states by the device tensor of slots each row reads and scatter them by the one it
    writes (index_select / index_copy_ on the state pool), and a replay first copies the batch's slots into
    those two tensors, as it copies the token ids and key slots."""

    def __init__(self, step: DecodeStep, max_rows: int, max_positions: int) -> None:
        self.step = step
        self.row_buckets = _powers_of_two(max_rows)
        self.key_buckets = _powers_of_two(-(-max_positions // KEY_ALIGN) * KEY_ALIGN, start=256)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, DecodeInputs, torch.Tensor,
                                                  RecurrentStates | None]] = {}
        self._pool = None

    def capture_all(self) -> None:
        for num_rows in reversed(self.row_buckets):  # largest first: the pool fits every later one
            for num_keys in reversed(self.key_buckets):
                self._capture(num_rows, num_keys)
        log.info("captured %d CUDA graphs of the decode step (rows %s, keys %s)", len(self._graphs),
                 self.row_buckets, self.key_buckets)

    def run(self, rows: list[DecodeRow]) -> torch.Tensor:
        kv = self.step.kv_cache
        longest = max(r.position + 1 - r.kv_start for r in rows)
        if len(rows) > self.row_buckets[-1] or longest > self.key_buckets[-1]:
            return self._run_uncaptured(rows)
        key = (_bucket(len(rows), self.row_buckets), _bucket(longest, self.key_buckets))
        if key not in self._graphs:
            self._capture(*key)
        graph, static, logits, static_states = self._graphs[key]
        inputs = build_inputs(rows, kv.block_size, kv.scratch_slot, num_rows=key[0], num_keys=key[1],
                              num_adapters=self.step.num_adapters, device=self.step.device)
        for dst, src in zip(static.tensors(), inputs.tensors()):
            dst.copy_(src, non_blocking=True)
        if static_states is not None:
            states = self.step.step_states(rows, key[0])
            assert states is not None
            static_states.read_slots.copy_(states.read_slots, non_blocking=True)
            static_states.write_slots.copy_(states.write_slots, non_blocking=True)
        graph.replay()  # launched, not awaited: the sampler's read of the logits waits for it
        return logits[:len(rows)].float()

    def _run_uncaptured(self, rows: list[DecodeRow]) -> torch.Tensor:
        kv = self.step.kv_cache
        inputs = build_inputs(rows, kv.block_size, kv.scratch_slot, num_adapters=self.step.num_adapters,
                              device=self.step.device)
        self.step._step_states = self.step.step_states(rows, len(rows))
        logits = self.step.forward(*inputs.tensors())
        return logits.float()

    def _capture(self, num_rows: int, num_keys: int) -> None:
        kv = self.step.kv_cache
        device = self.step.device
        scratch = self.step._scratch_row(min(num_keys, self.step.max_positions))
        static = build_inputs([scratch] * num_rows, kv.block_size, kv.scratch_slot, num_rows=num_rows,
                              num_keys=num_keys, num_adapters=self.step.num_adapters, device=device)
        # Hybrids: every row of the capture reads and writes the scratch slot; replays copy real slots in.
        static_states = self.step._step_states = self.step.step_states([scratch] * num_rows, num_rows)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm the kernels (and cuBLAS workspaces) outside the capture
                self.step.forward(*static.tensors())
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.step.forward(*static.tensors())
        self._pool = graph.pool()
        self._graphs[(num_rows, num_keys)] = (graph, static, logits, static_states)


def _powers_of_two(limit: int, start: int = 1) -> list[int]:
    sizes = [start]
    while sizes[-1] < limit:
        sizes.append(sizes[-1] * 2)
    return sizes


def _bucket(value: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= value)
