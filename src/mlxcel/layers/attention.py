"""Attention over a paged KV cache, shared by every decoder family.

The runner describes one engine step as an `AttentionContext`: which sequences take part,
how many new tokens each brings, and where their keys and values live in the block pool.
Models call `ctx.attend(layer, q, k, v)`; they never see blocks or masks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# The step being computed on this thread, for layers that choose kernels per row (quant.py).
_CURRENT_STEP: ContextVar[AttentionContext | None] = ContextVar("mlxcel_current_step", default=None)


def current_step() -> AttentionContext | None:
    return _CURRENT_STEP.get()


class KVCache:
    """Key and value tensors for every layer: [num_blocks * block_size, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size = block_size
        self.num_blocks = num_blocks

    @property
    def bytes_per_token(self) -> int:
        first = self.k[0]
        return 2 * len(self.k) * first.shape[1] * first.shape[2] * first.element_size()


@dataclass(frozen=True, slots=True)
class SequenceSlice:
    """One sequence's part of a step: `q_len` new tokens ending at position `kv_len - 1`."""

    q_start: int  # offset of its first new token in the flat token batch
    q_len: int
    kv_len: int  # positions 0..kv_len-1 exist after this step
    kv_start: int = 0  # first live position (spec N); earlier blocks may be freed
    block_table: tuple[int, ...] = ()


class AttentionContext:
    """Index tensors and masks for one step, computed once and reused by every layer."""

    def __init__(self, seqs: list[SequenceSlice], kv: KVCache | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.seqs = seqs
        self.kv = kv
        self.device = torch.device(device)
        self._masks: dict[tuple[str, int | None], object] = {}
        self.slot_mapping = self._slot_mapping() if kv is not None else None
        decode = [i for i, s in enumerate(seqs) if s.q_len == 1 and kv is not None]
        self.decode_rows = decode  # one batched path for every decode row, alone or not
        decode_set = set(self.decode_rows)
        self.other_rows = [i for i in range(len(seqs)) if i not in decode_set]
        self.num_tokens = sum(s.q_len for s in seqs)
        self.num_leading_single_rows = next((i for i, s in enumerate(seqs) if s.q_len != 1), len(seqs))
        self._prepare_decode_group()

    @contextlib.contextmanager
    def active(self) -> Iterator[AttentionContext]:
        """Make this the current step of the thread while the model runs it."""
        token = _CURRENT_STEP.set(self)
        try:
            yield self
        finally:
            _CURRENT_STEP.reset(token)

    # ---- index building (once per step) ----

    def _slots_for(self, seq: SequenceSlice, start: int, stop: int) -> torch.Tensor:
        assert self.kv is not None
        bs = self.kv.block_size
        pos = torch.arange(start, stop)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        return (table[pos // bs] * bs + pos % bs).to(self.device)

    def _slot_mapping(self) -> torch.Tensor:
        parts = [self._slots_for(s, s.kv_len - s.q_len, s.kv_len) for s in self.seqs]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=self.device)

    def _prepare_decode_group(self) -> None:
        if not self.decode_rows:
            return
        seqs = [self.seqs[i] for i in self.decode_rows]
        max_len = max(s.kv_len - s.kv_start for s in seqs)
        gather = torch.zeros(len(seqs), max_len, dtype=torch.long)
        key_pos = torch.full((len(seqs), max_len), -1, dtype=torch.long)
        for b, s in enumerate(seqs):
            n = s.kv_len - s.kv_start
            gather[b, :n] = self._slots_for(s, s.kv_start, s.kv_len).cpu()
            key_pos[b, :n] = torch.arange(s.kv_start, s.kv_len)
        self._decode_gather = gather.to(self.device)
        self._decode_key_pos = key_pos.to(self.device)
        self._decode_q_pos = torch.tensor([s.kv_len - 1 for s in seqs], device=self.device)
        self._decode_q_index = torch.tensor([s.q_start for s in seqs], device=self.device)
        # The runner puts decode rows first: then they are a plain slice, no gather or scatter.
        self._decode_rows_lead = [s.q_start for s in seqs] == list(range(len(seqs)))
        self._decode_is_padded = any(s.kv_len - s.kv_start != max_len for s in seqs)

    # ---- attention ----

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               scale: float, window: int | None = None) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the step's new tokens -> [T, Hq, D]."""
        if self.kv is None:
            return self._attend_uncached(q, k, v, scale, window)
        k_cache, v_cache = self.kv.k[layer], self.kv.v[layer]
        k_cache.index_copy_(0, self.slot_mapping, k)
        v_cache.index_copy_(0, self.slot_mapping, v)
        out = torch.empty_like(q)
        if self.decode_rows:
            decoded = self._attend_decode_group(q, k_cache, v_cache, scale, window)
            if self._decode_rows_lead:
                out[:len(self.decode_rows)] = decoded
            else:
                out[self._decode_q_index] = decoded
        for i in self.other_rows:
            s = self.seqs[i]
            slots = self._cached(("slots", i), lambda s=s: self._slots_for(s, s.kv_start, s.kv_len))
            keys, values = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
            out[s.q_start:s.q_start + s.q_len] = self._attend_one(
                q[s.q_start:s.q_start + s.q_len], keys, values, s, scale, window)
        return out

    def _attend_uncached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float, window: int | None) -> torch.Tensor:
        out = torch.empty_like(q)
        for s in self.seqs:
            rows = slice(s.q_start, s.q_start + s.q_len)
            out[rows] = self._attend_one(q[rows], k[rows], v[rows], s, scale, window)
        return out

    def _attend_one(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    s: SequenceSlice, scale: float, window: int | None) -> torch.Tensor:
        # [1, H, L, D] layout for SDPA.
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, keys, values))
        is_plain_causal = keys.shape[0] == q.shape[0] and (window is None or window >= s.kv_len)
        if is_plain_causal:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=q.shape[0] > 1,
                                                 scale=scale, enable_gqa=True)
        else:
            mask = self._prefill_mask(s, keys.shape[0], window)
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                                 enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)

    def _prefill_mask(self, s: SequenceSlice, num_keys: int, window: int | None) -> torch.Tensor:
        def build() -> torch.Tensor:
            key_pos = torch.arange(s.kv_len - num_keys, s.kv_len, device=self.device)
            q_pos = torch.arange(s.kv_len - s.q_len, s.kv_len, device=self.device).unsqueeze(1)
            mask = key_pos.unsqueeze(0) <= q_pos
            if window is not None:
                mask &= key_pos.unsqueeze(0) > q_pos - window
            return mask
        return self._cached(("prefill", s.q_start, window), build)

    def _attend_decode_group(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             scale: float, window: int | None) -> torch.Tensor:
        b, length = self._decode_gather.shape
        flat = self._decode_gather.reshape(-1)
        keys = k_cache.index_select(0, flat).view(b, length, *k_cache.shape[1:]).transpose(1, 2)
        values = v_cache.index_select(0, flat).view(b, length, *v_cache.shape[1:]).transpose(1, 2)
        rows = q[:b] if self._decode_rows_lead else q.index_select(0, self._decode_q_index)
        qh = rows.unsqueeze(2)  # [B, Hq, 1, D]
        # Every gathered key is visible to its (last-position) query unless padded or windowed.
        needs_mask = self._decode_is_padded or (window is not None and length > window)
        mask = self._cached(("decode", window), lambda: self._decode_mask(window)) if needs_mask else None
        out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
        return out.squeeze(2)

    def _decode_mask(self, window: int | None) -> torch.Tensor:
        mask = self._decode_key_pos >= 0
        if window is not None:
            mask &= self._decode_key_pos > (self._decode_q_pos.unsqueeze(1) - window)
        return mask[:, None, None, :]  # [B, 1, 1, L]

    def _cached(self, key: tuple, build):  # noqa: ANN001, ANN202 - tiny memo for per-step tensors
        if key not in self._masks:
            self._masks[key] = build()
        return self._masks[key]
