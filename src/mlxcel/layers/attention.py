"""Attention over a paged KV cache, shared by every decoder family.

The runner describes one engine step as an `AttentionContext`: which sequences take part,
how many new tokens each brings, and where their keys and values live in the block pool.
Models call `ctx.attend(layer, q, k, v)`; they never see blocks or masks. They also hand the
context to their projections (`quant.project` / `quant.linear`): it tells the quantized ones
which rows are decode rows (`num_decode_rows`). The decode step's `DecodeAttention` is the same
interface over one layer's cache tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from mlxcel.layers import kv_quant, paged_attention

if TYPE_CHECKING:
    from mlxcel.layers.recurrent import RecurrentStates


PREFILL_BLOCK = 64  # prefill queries attend in blocks of this many positions (see _attend_prefill)
# The CPU's flash attention multiplies queries in tiles of 32 rows; a tile of 1-3 rows takes a small-M
# matmul whose bits differ from a fuller tile's, so a call's last tile is padded to this many rows.
_CPU_Q_TILE, _CPU_MIN_TILE_ROWS = 32, 4


def _with_whole_tiles(q: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`q` [rows, H, D] and its mask [rows, keys], with zero rows (attending every key) appended where
    the last query tile would have fewer than _CPU_MIN_TILE_ROWS: so a prompt's last rows get the same
    bits whether they came with the rest of their block or alone after a prefix-cache hit."""
    short = q.shape[0] % _CPU_Q_TILE
    if q.device.type != "cpu" or short == 0 or short >= _CPU_MIN_TILE_ROWS:
        return q, mask
    extra = _CPU_MIN_TILE_ROWS - short
    return (torch.cat((q, q.new_zeros(extra, *q.shape[1:]))),
            torch.cat((mask, mask.new_ones(extra, mask.shape[1]))))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True, slots=True)
class ScoreRule:
    """What some families do to attention scores beyond scale and mask: Gemma 2 / Grok cap them
    (`softcap * tanh(s / softcap)`), gpt-oss adds one learned logit a head to the softmax's
    denominator (`sinks` [Hq]: an extra key that takes probability and gives no value)."""

    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def is_plain(self) -> bool:
        return self.softcap is None and self.sinks is None


PLAIN = ScoreRule()


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, rule: ScoreRule = PLAIN,
         mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """`F.scaled_dot_product_attention` over [B, H, L, D] (GQA by head groups), or, with a
    non-plain `rule`, the same attention written out: scores, the rule, mask, softmax, values."""
    if rule.is_plain:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, H, Lq, Lk]
    if rule.softcap is not None:
        scores = torch.tanh(scores / rule.softcap) * rule.softcap
    if is_causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
    if rule.sinks is not None:
        sink = rule.sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


class PagedKV(Protocol):
    """The paged KV tensors a step attends over, as the engine hands them in (engine/kv/tensors.py's
    `KVCache`): keys and values at cache slots `block_id * block_size + offset`, whose last block
    (from `scratch_slot` on) belongs to no sequence."""

    block_size: int
    scratch_slot: int

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def read(self, layer: int, index: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]: ...

    def turn_query(self, q: torch.Tensor) -> torch.Tensor: ...

    def turn_back_output(self, out: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class SequenceSlice:
    """One sequence's part of a step: `q_len` new tokens ending at position `kv_len - 1`."""

    q_start: int  # offset of its first new token in the flat token batch
    q_len: int
    kv_len: int  # positions 0..kv_len-1 exist after this step
    kv_start: int = 0  # first live position (spec N); earlier blocks may be freed
    block_table: tuple[int, ...] = ()
    # [start, end) position spans whose queries also see every key of the span (Gemma 3's image
    # placeholders, issue 43); a span lies within one chunk or among cached keys
    bidirectional: tuple[tuple[int, int], ...] = ()

    def key_end(self, q_lo: int, q_hi: int) -> int:
        """One past the last key that queries at positions [q_lo, q_hi) may see (causal: q_hi)."""
        return max([q_hi] + [end for start, end in self.bidirectional if start < q_hi and end > q_lo])


def overlay_spans(mask: torch.Tensor, q_pos: torch.Tensor, key_pos: torch.Tensor,
                  spans: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """`mask` [.., Lq, Lk] with every (query, key) pair inside one bidirectional span allowed."""
    for start, end in spans:
        in_q = (q_pos >= start) & (q_pos < end)
        in_k = (key_pos >= start) & (key_pos < end)
        mask = mask | (in_q & in_k)
    return mask


def _groups_prefill(device: torch.device) -> bool:
    """A GPU attends a step's prefill chunks in one call; the CPU in block-aligned calls."""
    return device.type != "cpu"


@dataclass(frozen=True, slots=True)
class _PrefillGroup:
    """A step's prefill chunks as one padded batch [B, queries] x [B, keys] (see `_prefill_group`)."""

    q_index: torch.Tensor  # [B, Lq] row of each query in the flat batch (0 for padding)
    slots: torch.Tensor  # [B, Lk] cache slot of each key (the scratch slot for padding)
    mask: torch.Tensor  # [B, 1, Lq, Lk] bool: may attend
    rows: torch.Tensor  # [real queries] their rows in the flat batch, in [B, Lq] order
    query_flat: torch.Tensor  # [real queries] their places in [B * Lq], the same order (no boolean index: a sync)


class AttentionContext:
    """Index tensors and masks for one step, computed once and reused by every layer."""

    def __init__(self, seqs: list[SequenceSlice], kv: PagedKV | None = None,
                 device: torch.device | str = "cpu", *, prefill_only: bool = False,
                 states: RecurrentStates | None = None) -> None:
        """`prefill_only`: every row is prompt (the runner's prefill chunks), a one-token chunk too,
        so it is computed as the same position of a whole prompt is (kernels and bits: see
        `num_decode_rows`). Without it the context is a plain forward, not an engine step.
        `states`: the recurrent layers' states of the step's sequences (layers/recurrent.py)."""
        self.seqs = seqs
        self.states = states
        # without a cache: the new keys and values of the layers that others reuse (`attend`)
        self._fresh: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.prefill_only = prefill_only
        self.kv = kv
        self.device = torch.device(device)
        self._masks: dict[tuple[str, int | None], object] = {}
        self.slot_mapping = self._slot_mapping() if kv is not None else None
        decode = [i for i, s in enumerate(seqs) if s.q_len == 1 and kv is not None and not prefill_only]
        self.decode_rows = decode  # one batched path for every decode row, alone or not
        decode_set = set(self.decode_rows)
        self.other_rows = [i for i in range(len(seqs)) if i not in decode_set]
        self.num_tokens = sum(s.q_len for s in seqs)
        self._prepare_decode_group()

    def num_decode_rows(self, num_rows: int) -> int | None:
        """How many leading rows of this step's activations [num_rows, ...] are decode rows, for the
        layers that pick a kernel per row (quant.py); None for a plain forward (picked by size).
        An engine prefill step (`prefill_only`) has none."""
        return 0 if self.prefill_only and num_rows == self.num_tokens else None

    # ---- index building (once per step) ----

    def _slots_for(self, seq: SequenceSlice, start: int, stop: int) -> torch.Tensor:
        return self._host_slots(seq, start, stop).to(self.device)

    def _host_slots(self, seq: SequenceSlice, start: int, stop: int) -> torch.Tensor:
        """The cache slots of positions start..stop of `seq`, on the host."""
        assert self.kv is not None
        bs = self.kv.block_size
        pos = torch.arange(start, stop)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        return table[pos // bs] * bs + pos % bs

    def _slot_mapping(self) -> torch.Tensor:
        parts = [self._host_slots(s, s.kv_len - s.q_len, s.kv_len) for s in self.seqs]
        return torch.cat(parts).to(self.device) if parts else torch.empty(0, dtype=torch.long, device=self.device)

    def _prepare_decode_group(self) -> None:
        if not self.decode_rows:
            return
        seqs = [self.seqs[i] for i in self.decode_rows]
        max_len = max(s.kv_len - s.kv_start for s in seqs)
        gather = torch.zeros(len(seqs), max_len, dtype=torch.long)
        key_pos = torch.full((len(seqs), max_len), -1, dtype=torch.long)
        for b, s in enumerate(seqs):
            n = s.kv_len - s.kv_start
            gather[b, :n] = self._host_slots(s, s.kv_start, s.kv_len)
            key_pos[b, :n] = torch.arange(s.kv_start, s.kv_len)
        self._decode_gather = gather.to(self.device)
        self._decode_key_pos = key_pos.to(self.device)
        self._decode_q_pos = torch.tensor([s.kv_len - 1 for s in seqs], device=self.device)
        self._decode_q_index = torch.tensor([s.q_start for s in seqs], device=self.device)
        # The runner puts decode rows first: then they are a plain slice, no gather or scatter.
        self._decode_rows_lead = [s.q_start for s in seqs] == list(range(len(seqs)))
        self._decode_is_padded = any(s.kv_len - s.kv_start != max_len for s in seqs)

    # ---- attention ----

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, *,
               scale: float, window: int | None = None, rule: ScoreRule = PLAIN,
               is_reused: bool = False) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the step's new tokens -> [T, Hq, D]. k = v = None: a layer
        that reuses layer `layer`'s keys and values (Gemma 4's KV sharing), written already this step;
        `is_reused`: later layers will (without a cache, these k and v are then kept for them)."""
        if self.kv is None:
            if k is None:
                k, v = self._fresh[layer]
            elif is_reused:
                self._fresh[layer] = (k, v)
            return self._attend_uncached(q, k, v, scale, window, rule)
        if k is not None:
            self.kv.write(layer, self.slot_mapping, k, v)
        q = self.kv.turn_query(q)
        out = torch.empty_like(q)
        if self.decode_rows:
            decoded = self._attend_decode_group(layer, q, scale, window, rule)
            if self._decode_rows_lead:
                out[:len(self.decode_rows)] = decoded
            else:
                out[self._decode_q_index] = decoded
        if self.other_rows and _groups_prefill(self.device):
            group = self._cached(("prefill-group", window), lambda: self._prefill_group(window))
            out[group.rows] = self._attend_prefill_group(layer, q, group, scale, rule)
            return self.kv.turn_back_output(out)
        for i in self.other_rows:
            s = self.seqs[i]
            slots = self._cached(("slots", i), lambda s=s: self._padded_slots(s))
            keys, values = self.kv.read(layer, slots, q.dtype)
            out[s.q_start:s.q_start + s.q_len] = self._attend_prefill(
                i, q[s.q_start:s.q_start + s.q_len], keys, values, s, scale, window, rule)
        return self.kv.turn_back_output(out)

    def _padded_slots(self, s: SequenceSlice) -> torch.Tensor:
        """Slots of positions kv_start.. up to the next PREFILL_BLOCK boundary; past kv_len, the scratch slot."""
        assert self.kv is not None
        slots = self._slots_for(s, s.kv_start, s.kv_len)
        num_padded = _round_up(s.kv_len, PREFILL_BLOCK) - s.kv_start
        padding = torch.full((num_padded - len(slots),), self.kv.scratch_slot, dtype=torch.long, device=self.device)
        return torch.cat((slots, padding))

    def _attend_prefill(self, index: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        s: SequenceSlice, scale: float, window: int | None, rule: ScoreRule) -> torch.Tensor:
        """A prefill chunk over the cache, in query blocks aligned to absolute positions.

        NOTE: query block [b, b + PREFILL_BLOCK) always attends over keys kv_start..b + PREFILL_BLOCK
        (missing ones masked), so a query row gets the same key count and bits whether its prompt came
        in one chunk, in several, or after a prefix-cache hit; the call's last query tile is padded to
        4 rows (_with_whole_tiles: torch's float32 attention splits queries by 32, and a split of 1-3
        rows sums in another order). A single call over the whole chunk would split it elsewhere.
        """
        first = s.kv_len - s.q_len  # position of the chunk's first query
        out = torch.empty_like(q)
        for block in range(first - first % PREFILL_BLOCK, s.kv_len, PREFILL_BLOCK):
            lo, hi = max(block, first) - first, min(block + PREFILL_BLOCK, s.kv_len) - first
            num_keys = _round_up(s.key_end(lo + first, hi + first), PREFILL_BLOCK) - s.kv_start
            num_keys = max(num_keys, block + PREFILL_BLOCK - s.kv_start)
            mask = self._cached(("prefill", index, block, window),
                                lambda: self._prefill_block_mask(s, block, lo + first, hi + first, window))
            rows, mask = _with_whole_tiles(q[lo:hi], mask)
            qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (rows, keys[:num_keys], values[:num_keys]))
            out[lo:hi] = sdpa(qh, kh, vh, mask=mask, scale=scale, rule=rule).squeeze(0).transpose(0, 1)[:hi - lo]
        return out

    def _prefill_group(self, window: int | None) -> _PrefillGroup:
        """Every prefill chunk of the step as one padded batch (a GPU's way): the queries' rows,
        the keys' slots, and the causal (and window) mask by absolute position."""
        assert self.kv is not None
        seqs = [self.seqs[i] for i in self.other_rows]
        num_q = max(s.q_len for s in seqs)
        num_keys = max(s.kv_len - s.kv_start for s in seqs)
        q_index = torch.zeros(len(seqs), num_q, dtype=torch.long)
        q_pos = torch.zeros(len(seqs), num_q, dtype=torch.long)
        is_query = torch.zeros(len(seqs), num_q, dtype=torch.bool)
        slots = torch.full((len(seqs), num_keys), self.kv.scratch_slot, dtype=torch.long)
        key_pos = torch.full((len(seqs), num_keys), -1, dtype=torch.long)
        for b, s in enumerate(seqs):
            first = s.kv_len - s.q_len
            q_index[b, :s.q_len] = torch.arange(s.q_start, s.q_start + s.q_len)
            q_pos[b, :s.q_len] = torch.arange(first, s.kv_len)
            is_query[b, :s.q_len] = True
            slots[b, :s.kv_len - s.kv_start] = self._host_slots(s, s.kv_start, s.kv_len)  # no device round trip
            key_pos[b, :s.kv_len - s.kv_start] = torch.arange(s.kv_start, s.kv_len)
        # The mask is built where it is used: on a GPU, from [B, Lq] and [B, Lk] positions, not uploaded whole.
        to = self.device
        key_pos, q_pos, is_query_on = key_pos.to(to)[:, None, :], q_pos.to(to)[:, :, None], is_query.to(to)
        mask = key_pos <= q_pos
        for b, s in enumerate(seqs):
            if s.bidirectional:
                mask[b] = overlay_spans(mask[b], q_pos[b], key_pos[b], s.bidirectional)
        mask &= key_pos >= 0
        if window is not None:
            mask &= key_pos > q_pos - window
        mask[:, :, 0] |= ~is_query_on  # a padding row attends one key (no NaN); its output is dropped
        return _PrefillGroup(q_index.to(to), slots.to(to), mask[:, None], q_index[is_query].to(to),
                             is_query.flatten().nonzero().squeeze(1).to(to))

    def _attend_prefill_group(self, layer: int, q: torch.Tensor, group: _PrefillGroup, scale: float,
                              rule: ScoreRule) -> torch.Tensor:
        """One attention call for every prefill chunk of the step: -> [rows, Hq, D] in `group.rows` order.

        NOTE: on a GPU, a call per sequence and query block cost more in launches than the
        attention itself (a 64-stream profile on an H200: most of the engine thread in them); the
        CPU keeps the block-aligned calls, whose bits do not depend on how a prompt was chunked."""
        assert self.kv is not None
        keys, values = self.kv.read(layer, group.slots, q.dtype)  # [B, keys, Hkv, D]
        qb, kb, vb = (t.transpose(1, 2) for t in (q[group.q_index], keys, values))
        out = sdpa(qb, kb, vb, mask=group.mask, scale=scale, rule=rule)
        return out.transpose(1, 2).flatten(0, 1).index_select(0, group.query_flat)

    def _prefill_block_mask(self, s: SequenceSlice, block: int, q_lo: int, q_hi: int,
                            window: int | None) -> torch.Tensor:
        end = max(block + PREFILL_BLOCK, _round_up(s.key_end(q_lo, q_hi), PREFILL_BLOCK))
        key_pos = torch.arange(s.kv_start, end, device=self.device).unsqueeze(0)
        q_pos = torch.arange(q_lo, q_hi, device=self.device).unsqueeze(1)
        mask = key_pos <= q_pos  # causal; keys not written yet lie past every query, so masked too
        if s.bidirectional:
            mask = overlay_spans(mask, q_pos, key_pos, s.bidirectional)
        if window is not None:
            mask &= key_pos > q_pos - window
        return mask

    def _attend_uncached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float, window: int | None, rule: ScoreRule) -> torch.Tensor:
        out = torch.empty_like(q)
        for s in self.seqs:
            rows = slice(s.q_start, s.q_start + s.q_len)
            out[rows] = self._attend_one(q[rows], k[rows], v[rows], s, scale, window, rule)
        return out

    def _attend_one(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    s: SequenceSlice, scale: float, window: int | None, rule: ScoreRule) -> torch.Tensor:
        # [1, H, L, D] layout for SDPA.
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, keys, values))
        is_plain_causal = (keys.shape[0] == q.shape[0] and (window is None or window >= s.kv_len)
                           and not s.bidirectional)
        if is_plain_causal:
            out = sdpa(qh, kh, vh, is_causal=q.shape[0] > 1, scale=scale, rule=rule)
        else:
            mask = self._prefill_mask(s, keys.shape[0], window)
            out = sdpa(qh, kh, vh, mask=mask, scale=scale, rule=rule)
        return out.squeeze(0).transpose(0, 1)

    def _prefill_mask(self, s: SequenceSlice, num_keys: int, window: int | None) -> torch.Tensor:
        def build() -> torch.Tensor:
            key_pos = torch.arange(s.kv_len - num_keys, s.kv_len, device=self.device)
            q_pos = torch.arange(s.kv_len - s.q_len, s.kv_len, device=self.device).unsqueeze(1)
            mask = key_pos.unsqueeze(0) <= q_pos
            if s.bidirectional:
                mask = overlay_spans(mask, q_pos, key_pos.unsqueeze(0), s.bidirectional)
            if window is not None:
                mask &= key_pos.unsqueeze(0) > q_pos - window
            return mask
        return self._cached(("prefill", s.q_start, window), build)

    def _attend_decode_group(self, layer: int, q: torch.Tensor, scale: float, window: int | None,
                             rule: ScoreRule) -> torch.Tensor:
        assert self.kv is not None
        keys, values = self.kv.read(layer, self._decode_gather, q.dtype)  # [B, L, Hkv, D]
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        b, length = keys.shape[0], keys.shape[2]
        rows = q[:b] if self._decode_rows_lead else q.index_select(0, self._decode_q_index)
        qh = rows.unsqueeze(2)  # [B, Hq, 1, D]
        # Every gathered key is visible to its (last-position) query unless padded or windowed.
        needs_mask = self._decode_is_padded or (window is not None and length > window)
        mask = self._cached(("decode", window), lambda: self._decode_mask(window)) if needs_mask else None
        return sdpa(qh, keys, values, mask=mask, scale=scale, rule=rule).squeeze(2)

    def _decode_mask(self, window: int | None) -> torch.Tensor:
        mask = self._decode_key_pos >= 0
        if window is not None:
            mask &= self._decode_key_pos > (self._decode_q_pos.unsqueeze(1) - window)
        return mask[:, None, None, :]  # [B, 1, 1, L]

    def _cached(self, key: tuple, build):  # noqa: ANN001, ANN202 - tiny memo for per-step tensors
        if key not in self._masks:
            self._masks[key] = build()
        return self._masks[key]


@torch.library.custom_op("mlxcel::write_kv", mutates_args=("cache",))
def write_kv(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """Write one key or value a row into its cache slot, in place.

    NOTE: an opaque op for inductor on CUDA. Traced as a plain `index_copy_` on a cache that the
    step reads afterwards, inductor's Triton lowering wrote a whole new cache and copied it back
    (two full-cache passes a layer: at a 64k-token pool 2.2 of the step's 4.4 ms on the H200); on
    the CPU the same trace is an in-place scatter fused with RoPE, so the CPU keeps it."""
    cache.index_copy_(0, slots, values.to(cache.dtype))


@write_kv.register_fake
def _write_kv_fake(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    return None


class DecodeAttention:
    """One layer's attention for a batch of single-token rows over the paged cache, as plain
    tensor ops.

    Everything it reads is a tensor (that layer's cache tensors among them), so one layer of the
    decode step traces whole and every layer shares the trace (torch.compile on CPU, CUDA graph
    capture on GPU). Each row attends over its own live keys only: a row's keys are padded with
    masked slots up to the batch's key length, and a masked key adds an exact zero to every sum.
    """

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 key_slots: torch.Tensor, key_pos: torch.Tensor, q_pos: torch.Tensor, *,
                 k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
                 k_type: str = "", v_type: str = "", rotation: kv_quant.Rotation | None = None) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache  # [slots, Hkv, D] of this layer (codes if quantized)
        self.k_scales, self.v_scales = k_scales, v_scales  # [slots, Hkv, D / 32] when quantized
        self.k_type, self.v_type, self.rotation = k_type, v_type, rotation
        self.states: RecurrentStates | None = None  # the step's recurrent states (layers/recurrent.py), if any
        self.slot_mapping = slot_mapping  # [B] where each row's new key goes
        self.key_slots = key_slots  # [B, L] cache slots of each row's live keys, padding -> scratch
        self.key_pos = key_pos  # [B, L] their positions, -1 for padding
        self.q_pos = q_pos  # [B] position of each row's query
        # CPU, unquantized: the paged kernel reads each row's keys from their slots (read here,
        # outside any compiled region, so a traced step sees a constant).
        self.use_kernel = (k_scales is None and v_scales is None and k_cache.dtype == v_cache.dtype
                           and paged_attention.supports(k_cache.dtype, k_cache.device))

    def num_decode_rows(self, num_rows: int) -> int:
        """Every row of the decode step is a decode row (see `AttentionContext.num_decode_rows`)."""
        return num_rows

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, *,
               scale: float, window: int | None = None, rule: ScoreRule = PLAIN,
               is_reused: bool = False) -> torch.Tensor:
        """q: [B, Hq, D], k/v: [B, Hkv, D] -> [B, Hq, D]; `layer` is implied by the cache tensors.
        k = v = None: the layer reuses these tensors' keys and values (KV sharing), written this step already."""
        if k is not None:
            self._write(self.k_type, self.k_cache, self.k_scales, k)
        if k is not None and self.v_cache is not self.k_cache:  # else values are keys (KVCache.values_are_keys)
            self._write(self.v_type, self.v_cache, self.v_scales, v)
        if self.use_kernel and rule.is_plain:
            return paged_attention.paged_decode_attention(q, self.k_cache, self.v_cache, self.key_slots, self.key_pos,
                                                          self.q_pos, scale, window or 0)
        visible = self.key_pos >= 0
        if window is not None:
            visible = visible & (self.key_pos > (self.q_pos.unsqueeze(1) - window))
        compute = _attention_dtype(q, self.k_cache.dtype if self.k_scales is None else q.dtype)
        keys = kv_quant.decode(self.k_type, self.k_cache[self.key_slots], _at(self.k_scales, self.key_slots), compute)
        values = kv_quant.decode(self.v_type, self.v_cache[self.key_slots], _at(self.v_scales, self.key_slots), compute)
        turned = self.k_type == "turbo4"
        out = decode_attention(self.rotation.turn(q) if turned else q, keys, values, visible, scale, rule)
        return self.rotation.turn_back(out) if self.v_type == "turbo4" else out

    def _write(self, element: str, cache: torch.Tensor, scales: torch.Tensor | None, x: torch.Tensor) -> None:
        if element == "turbo4":
            x = self.rotation.turn(x)
        codes, new_scales = kv_quant.encode(element, x) if scales is not None else (x, None)
        for target, values in ((cache, codes), (scales, new_scales)):
            if target is None:
                continue
            if target.is_cuda:
                write_kv(target, self.slot_mapping, values)
            else:
                target.index_copy_(0, self.slot_mapping, values.to(target.dtype))


def _at(scales: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if scales is None else scales[index]


def _attention_dtype(q: torch.Tensor, cache_dtype: torch.dtype) -> torch.dtype:
    """float32 where the sums are fused (compiled or CPU), else the cache's dtype (batched GPU matmuls)."""
    return torch.float32 if torch.compiler.is_compiling() or q.device.type == "cpu" else cache_dtype


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                     scale: float, rule: ScoreRule = PLAIN) -> torch.Tensor:
    """Grouped-query attention of one query a row: q [B, Hq, D]; keys, values [B, L, Hkv, D] (already
    gathered from the cache, in the dtype the sums run in); visible [B, L].

    A masked key contributes exactly 0 (probability exp(lowest - max) = 0 times a finite value). On the
    CPU the products are summed along one axis in float32: each row's sums then have the same
    bits whatever the batch (batched matmuls do not promise that), and inductor fuses them with
    the gather from the cache. On CUDA two batched matmuls in the cache's dtype (the GPU
    accumulates in float32), which a CUDA graph replays.
    """
    b, num_kv_heads, head_dim = keys.shape[0], keys.shape[2], keys.shape[3]
    groups = q.shape[1] // num_kv_heads
    is_fused = torch.compiler.is_compiling() or q.device.type == "cpu"
    compute = keys.dtype
    qg = q.to(compute).view(b, num_kv_heads, groups, head_dim)
    if is_fused:
        scores = (qg.unsqueeze(1) * keys.unsqueeze(3)).sum(-1).permute(0, 2, 3, 1)  # [B, Hkv, G, L]
    else:
        scores = torch.einsum("bhgd,blhd->bhgl", qg, keys)
    # The lowest finite float, not -inf: a padding row with no visible key stays finite (it
    # writes the scratch slot other rows' masked keys point at), and exp() of it is still 0.
    scores = scores.float() * scale
    if rule.softcap is not None:
        scores = torch.tanh(scores / rule.softcap) * rule.softcap
    scores = scores.masked_fill(~visible[:, None, None, :], torch.finfo(torch.float32).min)
    if rule.sinks is not None:  # [Hq] -> one extra key a head: [B, Hkv, G, 1]
        sink = rule.sinks.float().view(1, num_kv_heads, groups, 1).expand(b, -1, -1, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1].to(compute)
    else:
        probs = torch.softmax(scores, dim=-1).to(compute)
    if is_fused:
        out = (probs.unsqueeze(-1) * values.permute(0, 2, 1, 3).unsqueeze(2)).sum(3)  # [B, Hkv, G, D]
    else:
        out = torch.einsum("bhgl,blhd->bhgd", probs, values)
    return out.reshape(b, num_kv_heads * groups, head_dim).to(q.dtype)
