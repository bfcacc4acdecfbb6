"""Weight-only quantized linears for CPU decode: a rewrite of a finished model (DESIGN rule 3).

At one token a step a linear is bound by the bytes of its weights. `QuantLinear` keeps each
weight packed for the decode kernels and, unless our 4-bit kernel serves it (below), as bfloat16
for prefill, where oneDNN's bfloat16 matmul wins from about 8 rows (PERF.md) over ATen's packed
kernels. The packed form is 4-bit (groups of 32) when
that is lossless, i.e. when the weight came from a 4-bit GGUF type (Q4_0, Q4_1, Q4_K: every group
of 32 lies on a 16-level grid), the file's own int8 codes and group scales for Q8_0 / Q5_0 / Q6_K
(issue 27; packed in 6 bits where they fit, `int6_blocks`), and per-channel int8 otherwise: no second rounding of already-quantized weights, and
half the bytes where the checkpoint allows it. The kernels take and give float32 rows.

The decode kernels are ours (kernels/decode_layers.cpp) where the CPU kernels build: `int4_linear`
quantizes each row's activations to int8 per group of 32, as llama.cpp does, and sums in int32
with VNNI (1.5-2.8x ATen's 4-bit kernel on SmolLM2's shapes; the product of the weights with one
rounding of the activations, llama.cpp's Q8_1 product: bench/RESULTS.md issue 27), and as fast as oneDNN's bfloat16 matmul at prefill sizes, so it
takes every row and such a weight is kept once (issue 11 point 5); `int8_linear` streams
transposed blocks of 64 outputs. Elsewhere
ATen's `_weight_int4pack_mm_for_cpu` / `_weight_int8pack_mm`. Each linear picks once, when built.

Otherwise, inside an engine step the kernel is picked per row, not per step: the rows of single-token
sequences (decode) go through the packed kernel, the rows of prefill chunks through
bfloat16. Both give each row the same bits whatever else is in the batch, so a request's
greedy output does not depend on its batch neighbours. The step is an explicit argument: the
families call their projections through `project` / `linear` with the attention context they
were given, which says how many leading rows are decode rows (`Step`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol, Union

import torch
import torch.nn.functional as F
from torch import nn

from mlxcel.layers import paged_attention

PACKED_MAX_ROWS = 8  # outside an engine step, fewer rows than this use the packed kernel


INT4_GROUP = 32  # GGUF's 4-bit types scale blocks of 32 weights


class Int4Levels(NamedTuple):
    """A weight [N, K] on a 4-bit grid per group of 32 along K: w = low + q * step."""

    q: torch.Tensor  # uint8 [N, K], 0..15
    step: torch.Tensor  # float32 [N, K / 32]
    low: torch.Tensor  # float32 [N, K / 32]
    # float32 [N, K / 256, 2] or None: a K-quant's superblock scales (d, -dmin), of which each step and low
    # is an integer multiple (`group_scales` then keeps the small integers, not the float32 products).
    units: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        q = self.q.view(n, k // INT4_GROUP, INT4_GROUP).float()
        return (self.low[..., None] + q * self.step[..., None]).view(n, k)

    @staticmethod
    def cat(parts: list[Int4Levels]) -> Int4Levels:
        return Int4Levels(*(torch.cat(tensors) for tensors in zip(*(p[:3] for p in parts))), _cat_units(parts))


class Int8Levels(NamedTuple):
    """A weight [N, K] as a GGUF Q8_0 / Q5_0 / Q6_K stores it: int8 codes and one scale per group of
    K / scale.shape[1] along K (32, or 16 for Q6_K): w = code * scale, exact; with lows, w = low +
    code * scale (4-bit levels stacked with such codes in one fused linear, `_cat_weights`)."""

    codes: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K / group]
    low: torch.Tensor | None = None  # float32 [N, K / group]
    # float32 [N, K / 256, 1 or 2 (with lows)] or None: a K-quant's superblock scales, of which each group's
    # scale (and low) is an integer multiple (Q6_K: d times an int8 scale).
    units: torch.Tensor | None = None

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        w = self.codes.view(n, -1, self.group).float() * self.scale[..., None]
        return (w if self.low is None else w + self.low[..., None]).view(n, k)

    def regrouped(self, group: int) -> Int8Levels:
        """The same weight with scales (and lows) repeated for groups of `group` (dividing this one's)."""
        times = self.group // group
        return Int8Levels(self.codes, self.scale.repeat_interleave(times, dim=1),
                          None if self.low is None else self.low.repeat_interleave(times, dim=1), self.units)

    @staticmethod
    def of(weight: Int4Levels | Int8Levels, group: int) -> Int8Levels:
        """`weight` as int8 codes with scales and lows per `group` (4-bit levels become codes 0..15)."""
        if isinstance(weight, Int4Levels):
            weight = Int8Levels(weight.q.to(torch.int8), weight.step, weight.low, weight.units)
        low, units = weight.low, weight.units
        if low is None:  # no lows: zero ones, whose unit is 0
            low = torch.zeros_like(weight.scale)
            units = None if units is None else torch.cat((units, torch.zeros_like(units)), dim=-1)
        return Int8Levels(weight.codes, weight.scale, low, units).regrouped(group)

    @staticmethod
    def cat(parts: list[Int4Levels | Int8Levels]) -> Int8Levels:
        """Stacked along the outputs, at the smallest group; lows where any part has them."""
        group = min(INT4_GROUP if isinstance(p, Int4Levels) else p.group for p in parts)
        if all(isinstance(p, Int8Levels) and p.low is None for p in parts):
            same = [p.regrouped(group) for p in parts]  # type: ignore[union-attr]
            return Int8Levels(torch.cat([p.codes for p in same]), torch.cat([p.scale for p in same]), None,
                              _cat_units(same))
        same = [Int8Levels.of(p, group) for p in parts]
        return Int8Levels(*(torch.cat(tensors) for tensors in zip(*(p[:3] for p in same))), _cat_units(same))


def _cat_units(parts: list[Int4Levels] | list[Int8Levels]) -> torch.Tensor | None:
    """Stacked parts' superblock units, where every part has them."""
    return None if any(p.units is None for p in parts) else torch.cat([p.units for p in parts])


# A linear's weight as `quantize` gets it: float [N, K], or the codes a quantized checkpoint stores
# (`PackedWeights`: 4-bit levels, or int8 codes with a scale per group), which need no search for
# their grid and are never rounded again.
Weight = Union[torch.Tensor, Int4Levels, Int8Levels]


class PackedWeights(Protocol):
    """What a checkpoint stores in a 4-bit type (loading/ sets one on the models it builds from
    a GGUF as `model.packed_weights`; `quantize` reads it)."""

    def int4_levels(self, name: str) -> Int4Levels | None:
        """The levels of parameter `name` (HF naming) when the file stores it in a 4-bit type; None
        when it stores it otherwise (then no grid is searched for: it goes int8)."""
        ...

    def int8_levels(self, name: str) -> Int8Levels | None:
        """The codes and group scales of parameter `name` when the file stores it as int8 codes times a
        scale per group (Q8_0, Q5_0, Q6_K); None otherwise."""
        ...


class Step(Protocol):
    """The step a projection runs in: the model's attention context (layers/attention.py's
    `AttentionContext` or the decode step's `DecodeAttention`)."""

    def num_decode_rows(self, num_rows: int) -> int | None:
        """How many leading rows of an activation [num_rows, ...] are decode rows; None outside an engine step."""
        ...


class QuantLinear(nn.Module):
    """y = x @ W.T (+ b), W kept packed (4-bit when lossless, else int8) and, unless our 4-bit kernel
    serves every row, as bfloat16 for prefill rows."""

    def __init__(self, weight: Weight, bias: torch.Tensor | None, *, keep_dense: bool = False,
                 search: bool = True, packed_only: bool = False) -> None:
        """`weight`: float, or a checkpoint's 4-bit levels or int8 codes. `keep_dense`: keep the bfloat16 copy
        even on our kernels. `search`: look for a 4-bit grid in a float weight (off when the checkpoint says
        it is stored otherwise: the search costs most of a load). `packed_only`: keep no bfloat16 copy in any
        case, every row takes the packed kernel (issue 40: an MoE's experts, most of its weights)."""
        super().__init__()
        grid = (weight if isinstance(weight, Int4Levels) else None if isinstance(weight, Int8Levels)
                else int4_grid(weight.detach().float()) if search else None)
        # Issue 27: biases stay float32 (the outputs are float32).
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.out_features, self.in_features = (grid.q if grid is not None else weight.codes
                                               if isinstance(weight, Int8Levels) else weight).shape
        # 4-bit: our kernel (int8 activations, integer dot products; kernels/decode_layers.cpp) where
        # the CPU kernels build and N is whole blocks of 16, else ATen's; chosen once here, so every
        # row of every step takes the same one.
        self.int4_kernel = grid is not None and self.out_features % INT4_BLOCK == 0 and paged_attention.available()
        int4 = (None if grid is None else int4_blocks(*grid) if self.int4_kernel
                else aten_int4_pack(*grid[:3]) if can_pack_int4() else None)
        self.bits = 4 if int4 is not None else 8
        # Issue 27: a checkpoint's int8 codes with group scales (Q8_0 / Q5_0 / Q6_K) stay as stored, on our
        # int8 kernel (whole blocks of 64 outputs); elsewhere they are dequantized and rounded per row.
        stored = (weight if isinstance(weight, Int8Levels) and self.out_features % INT8_BLOCK == 0
                  and paged_attention.available() else None)
        self.int8_kernel = False
        # Issue 11 point 5: on our 4-bit kernel every row takes it, prefill too (as fast as oneDNN's
        # bfloat16 matmul from 64 to 512 rows here: bench/RESULTS.md), so the weight is kept once,
        # packed; elsewhere a bfloat16 copy serves prefill rows. Stored int8 codes likewise (issue 27:
        # a bfloat16 copy would round them).
        is_kept_once = packed_only or ((self.int4_kernel or stored is not None) and not keep_dense)
        w = (None if is_kept_once and (int4 is not None or stored is not None)
             else weight.dequantize() if isinstance(weight, (Int4Levels, Int8Levels)) else weight.detach().float())
        self.register_buffer("weight", None if w is None or is_kept_once else w.to(torch.bfloat16))
        if int4 is not None:
            self.register_buffer("qweight", int4[0])
            self.register_buffer("scale", int4[1])  # ATen's: [K / 32, N, 2] scale and zero; ours: see int4_blocks
        elif stored is not None:
            self.int8_kernel = True
            # Issue 27: 6-bit codes (Q6_K, Q5_0, 4-bit levels fused with them) in 0.75 bytes, not 1.
            self.register_buffer("qweight", int6_blocks(stored.codes) if fits_int6(stored) else int8_blocks(stored.codes))
            self.register_buffer("scale", int8_group_scales(stored))
        else:
            scale, codes = int8_codes(w if w is not None else weight.dequantize())  # type: ignore[union-attr]
            # Our kernel (kernels/decode_layers.cpp, where the CPU kernels build) reads the weight in
            # transposed blocks of 64 outputs (`int8_blocks`); ATen's [out, in]. Chosen once here, so
            # every row of every step takes the same kernel (ours is 2-3x faster at a few rows).
            self.int8_kernel = paged_attention.available()
            self.register_buffer("qweight", int8_blocks(codes) if self.int8_kernel else codes)
            self.register_buffer("scale", scale.to(torch.bfloat16))

    def forward(self, x: torch.Tensor, step: Step | None = None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        num_packed = rows.shape[0] if self.weight is None else _num_packed_rows(rows.shape[0], step)
        if num_packed == rows.shape[0]:
            y = self.packed_rows(rows)
        elif num_packed == 0:
            y = self.dense_rows(rows)
        else:
            y = torch.cat((self.packed_rows(rows[:num_packed]), self.dense_rows(rows[num_packed:])))
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def packed_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The decode kernel on rows [M, in_features] -> float32. Ours take the rows in float32 and sum in
        float32 (issue 27: no bfloat16 rounding on the way in or out); ATen's take bfloat16."""
        if self.int4_kernel and x.device.type == "cpu":
            y = torch.ops.mlxcel.int4_linear(x.float(), self.qweight, self.scale)
        elif self.bits == 4:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.qweight, INT4_GROUP,
                                                           self.scale).float()
        elif self.int8_kernel and x.device.type == "cpu":
            y = torch.ops.mlxcel.int8_linear(x.float(), self.qweight, self.scale)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scale).float()
        return y if self.bias is None else y + self.bias

    def dense_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Prefill rows through the bfloat16 copy (oneDNN's matmul) -> float32."""
        y = F.linear(x.to(torch.bfloat16), self.weight).float()
        return y if self.bias is None else y + self.bias


INT8_BLOCK = 64  # output rows a block of `int8_blocks`
CODES_ROWS = 4096  # rows rounded at a time: an output head's float temporaries stay a slice's size


def int8_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: scales [N] (float32) and codes [N, K] (w ~ codes * scale)."""
    scale = torch.empty(w.shape[0])
    codes = torch.empty(w.shape, dtype=torch.int8)
    for rows in range(0, w.shape[0], CODES_ROWS):
        part = w[rows:rows + CODES_ROWS]
        part_scale = (part.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        codes[rows:rows + CODES_ROWS] = torch.round(part / part_scale[:, None]).clamp(-127, 127)
        scale[rows:rows + CODES_ROWS] = part_scale
    return scale, codes


def int8_blocks(codes: torch.Tensor) -> torch.Tensor:
    """int8 [out, in] -> [ceil(out / 64), in, 64]: blocks of 64 output rows, each transposed (zeros past
    `out`), so that the kernel's work item for 64 outputs streams one contiguous block."""
    out, inputs = codes.shape
    padded = torch.zeros(-(-out // INT8_BLOCK) * INT8_BLOCK, inputs, dtype=codes.dtype)
    padded[:out] = codes
    return padded.view(-1, INT8_BLOCK, inputs).transpose(1, 2).contiguous()


INT6_CHUNK = 16  # inputs a chunk of `int6_blocks`: 3 dwords an output


def fits_int6(levels: Int8Levels) -> bool:
    """Whether stored codes pack in 6 bits for the int8 kernel: all in -32..31, groups whole chunks of 16."""
    codes = levels.codes
    return (levels.group % INT6_CHUNK == 0 and codes.numel() > 0 and int(codes.min()) >= -32
            and int(codes.max()) <= 31)


def int6_blocks(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [out, in] in -32..31 (out a multiple of 64, in of 16) -> int32 [out / 64, in / 16, 3, 64]:
    per block of 64 outputs and chunk of 16 inputs, 3 dwords an output, dword j holding the codes of inputs
    5 j .. 5 j + 4 as code + 32, 6 bits each from bit 0, 0, 2 (`INT6_BASES`), and bits 2 j, 2 j + 1 of input
    15's code (two's complement) in its other two bits, 30-31, 30-31, 0-1 (kernels/decode_layers.cpp
    `int6_block`, which unpacks them exactly; `int6_pack` packs them)."""
    if not paged_attention.available():
        raise RuntimeError("6-bit codes need the CPU kernels (no C++ compiler)")
    return torch.ops.mlxcel.int6_pack(codes)


INT6_BASES = (0, 0, 2)  # bit of each dword's first code (`int6_blocks`)
_INT6_SPARE = (30, 30, 0)  # where each dword keeps 2 bits of input 15's code
_INT6_SHIFTS = torch.tensor([[b + 6 * f for f in range(5)] for b in INT6_BASES]).view(3, 5, 1)


def int6_codes(packed: torch.Tensor) -> torch.Tensor:
    """`int6_blocks`' inverse: the int8 codes [out, in]."""
    words = packed.to(torch.int64) & 0xFFFFFFFF  # [block, chunk, 3, output]
    fields = ((words[:, :, :, None] >> _INT6_SHIFTS) & 63) - 32  # [block, chunk, 3, 5, output]
    last = (((words >> torch.tensor(_INT6_SPARE).view(3, 1)) & 3) << (2 * torch.arange(3).view(3, 1))).sum(2, keepdim=True)
    chunks = torch.cat((fields.flatten(2, 3), torch.where(last >= 32, last - 64, last)), dim=2)
    blocks, num_chunks = packed.shape[:2]
    return chunks.permute(0, 3, 1, 2).reshape(blocks * INT8_BLOCK, num_chunks * INT6_CHUNK).to(torch.int8)


def int8_group_scales(levels: Int8Levels) -> torch.Tensor:
    """A stored int8 weight's group scales (and lows) as `group_scales` keeps them for the blocks of
    `int8_blocks` (without lows and not in Units, one dimension less: [N / 64, K / group, 64])."""
    parts = [levels.scale] if levels.low is None else [levels.scale, levels.low]
    scales = group_scales(parts, INT8_BLOCK, levels.units, torch.int8)
    return scales[:, :, 0] if levels.low is None and scales.dtype != torch.uint8 else scales


def group_scales(parts: list[torch.Tensor], width: int, units: torch.Tensor | None,
                 sub_dtype: torch.dtype) -> torch.Tensor:
    """Group scales (and lows) `parts`, each float32 [N, G], for blocks of `width` outputs in the smallest of
    the kernels' three forms that keeps them exactly (kernels/decode_layers.cpp `Scales`):
    Units, uint8 [N / width, G / per_unit, parts, 4 width + per_unit width]: per superblock of 256 inputs
    and part, `width` float32 units then `per_unit` x `width` integer sub-scales (`sub_dtype`), when
    `units` [N, K / 256, parts] divide every value into such integers (a K-quant's d and 6- or 8-bit
    scales); else float16 [N / width, G, parts, width] when every value is a float16 (Q4_0, Q4_1, Q8_0,
    Q5_0); else float32, the same. A 4-bit weight's scales are half of its bytes in float32 (Q4_K: 0.75
    bytes a weight against its 0.56 in the file), a quarter in Units."""
    n, groups = parts[0].shape
    blocks = n // width
    stacked = torch.stack([p.float() for p in parts], dim=-1)  # [N, G, parts]
    subs = _integer_multiples(stacked, units, sub_dtype)
    if subs is not None:
        per_unit = groups // units.shape[1]
        unit_bytes = units.float().view(blocks, width, -1, len(parts)).permute(0, 2, 3, 1).contiguous()
        sub_bytes = subs.view(blocks, width, -1, per_unit, len(parts)).permute(0, 2, 4, 3, 1).contiguous()
        return torch.cat((unit_bytes.view(torch.uint8).flatten(3), sub_bytes.view(torch.uint8).flatten(3)), dim=3)
    in_blocks = stacked.view(blocks, width, groups, len(parts)).permute(0, 2, 3, 1).contiguous()
    half = in_blocks.half()
    return half if bool(torch.equal(half.float(), in_blocks)) else in_blocks


def _integer_multiples(values: torch.Tensor, units: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """values [N, G, parts] as integers of `dtype` times `units` [N, G / per_unit, parts] (each value exactly
    unit * integer); None when some value is not."""
    if units is None or values.shape[1] % units.shape[1] or units.shape[2] != values.shape[2]:
        return None
    unit = units.float().repeat_interleave(values.shape[1] // units.shape[1], dim=1)
    multiples = torch.where(unit != 0, values / unit, torch.zeros_like(values)).round()
    info = torch.iinfo(dtype)
    exact = torch.equal(unit * multiples, values) and bool(((multiples >= info.min) & (multiples <= info.max)).all())
    return multiples.to(dtype) if exact else None


def int4_grid(w: torch.Tensor) -> Int4Levels | None:
    """`w` [N, K] as levels q [N, K] (0..15), steps and lows [N, K / 32] (w = low + q * step) when every
    group of 32 along K already lies on a 16-level grid (a 4-bit source read as floats); None otherwise."""
    n, k = w.shape
    if k % INT4_GROUP:
        return None
    groups = w.float().view(n, k // INT4_GROUP, INT4_GROUP)
    low = groups.amin(-1)
    step = _grid_steps(groups, low, tolerance=1e-4 * float(w.abs().amax()))
    if step is None:  # not a 4-bit source: int8 keeps more
        return None
    q = torch.round((groups - low[..., None]) / step[..., None]).clamp(0, 15)
    return Int4Levels(q.to(torch.uint8).view(n, k), step, low)


def pack_int4_if_lossless(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """ATen's 4-bit CPU packing of `w` [N, K] (see `int4_grid`), with bfloat16 scales."""
    grid = int4_grid(w) if can_pack_int4() else None
    return None if grid is None else aten_int4_pack(*grid[:3])


def aten_int4_pack(q: torch.Tensor, step: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`int4_grid`'s levels, steps and lows in ATen's 4-bit CPU layout (`_weight_int4pack_mm_for_cpu`)."""
    # The kernel computes (q - 8) * scale + zero, so zero = low + 8 * scale.
    scales = torch.stack((step, low + 8 * step), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
    return packed, scales


INT4_BLOCK = 16  # output rows a block of `int4_blocks`


def int4_blocks(q: torch.Tensor, step: torch.Tensor, low: torch.Tensor,
                units: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout of our int4 kernel (kernels/decode_layers.cpp `int4_linear`) from `Int4Levels`'
    levels [N, K], steps and lows [N, K / 32] (N a multiple of 16): packed uint8 [N / 16, K / 32, 4, 64],
    byte 4 i + t of vector v holding output i's level at k = 4 v + t of the group (low nibble) and at
    16 + 4 v + t (high nibble); steps and lows as `group_scales` stores them for blocks of 16."""
    n, k = q.shape
    blocks, groups = n // INT4_BLOCK, k // INT4_GROUP
    packed = torch.empty(blocks, groups, 4, 64, dtype=torch.uint8)
    for start in range(0, blocks, PACK_BLOCKS):  # a slice of blocks at a time: the temporaries stay its size
        part = q[start * INT4_BLOCK:(start + PACK_BLOCKS) * INT4_BLOCK]
        levels = part.view(-1, INT4_BLOCK, groups, 2, 4, 4)  # [block, i, group, half, v, t]
        levels = levels.permute(0, 2, 4, 1, 5, 3)  # [block, group, v, i, t, half]
        packed[start:start + PACK_BLOCKS] = (levels[..., 0] | (levels[..., 1] << 4)).reshape(-1, groups, 4, 64)
    return packed, group_scales([step, low], INT4_BLOCK, units, torch.uint8)


PACK_BLOCKS = 256  # blocks of 16 outputs `int4_blocks` packs at a time


def _grid_steps(groups: torch.Tensor, low: torch.Tensor, tolerance: float) -> torch.Tensor | None:
    """Each group's grid step, such that its values are low + q * step with integer q in 0..15;
    None when some group has none.

    Where a group spans all 16 levels (Q4_0/Q4_1: the scale is set from the group's range) the
    step is range / 15. A K-quant (Q4_K) derives its 6-bit sub-block scales otherwise, so a
    group may use only some levels: its step is then the smallest gap between its values, or a
    half or third of it when no two values lie on neighbouring levels.
    """
    shape = low.shape
    groups, low = groups.reshape(-1, groups.shape[-1]), low.reshape(-1)
    high = groups.amax(-1)
    step = torch.full_like(low, float("nan"))
    # Most groups span all 16 levels: only the others pay for the sort (most of the load time of a Q4_K model).
    first = ((high - low) / 15).clamp(min=1e-12)
    fits = _fits_grid(groups, low, first, tolerance)
    step[fits] = first[fits]
    rest = (~fits).nonzero().squeeze(1)
    if rest.numel():
        sub, sub_low = groups[rest], low[rest]
        gaps = sub.sort(-1).values.diff(dim=-1)
        smallest_gap = gaps.masked_fill(gaps <= tolerance, float("inf")).amin(-1)
        sub_step = torch.full_like(sub_low, float("nan"))
        for candidate in (smallest_gap, smallest_gap / 2, smallest_gap / 3):
            candidate = candidate.clamp(min=1e-12)
            sub_step = torch.where(_fits_grid(sub, sub_low, candidate, tolerance) & sub_step.isnan(), candidate,
                                   sub_step)
        step[rest] = sub_step
    flat = high - low <= tolerance  # one value: any step (q = 0)
    step = torch.where(flat & step.isnan(), torch.ones_like(step), step)
    return None if bool(step.isnan().any()) else step.view(shape)


def _fits_grid(groups: torch.Tensor, low: torch.Tensor, step: torch.Tensor, tolerance: float) -> torch.Tensor:
    """Which groups [G, 32] lie on low + q * step with integer q in 0..15 (within `tolerance`)."""
    levels = torch.round((groups - low[:, None]) / step[:, None])
    error = (levels * step[:, None] + low[:, None] - groups).abs().amax(-1)
    return (error <= tolerance) & (levels.amax(-1) <= 15)


def _num_packed_rows(num_rows: int, step: Step | None) -> int:
    """How many leading rows take the packed kernel: an engine step's decode rows, else by size."""
    if torch.compiler.is_compiling():
        # NOTE: only the decode step is compiled, and all its rows are decode rows; asking the
        # step here would only add to the traced layer's guards.
        return num_rows
    num_decode = step.num_decode_rows(num_rows) if step is not None else None
    if num_decode is not None:
        return num_decode
    return num_rows if num_rows < PACKED_MAX_ROWS else 0


class QuantHead(nn.Module):
    """Output head: packed-kernel logits in float32; a head rounded from float weights per row to int8 has
    its top candidates recomputed from its bfloat16 copy with float32 accumulation.

    bfloat16 logits near 25 are only resolved to 0.125, enough to flip a greedy choice (SmolLM2's "The"
    vs "L" differ by 0.08), and a per-row int8 rounding moves them about as much. A head the checkpoint
    stores quantized (4-bit levels, Q8_0 / Q5_0 / Q6_K codes) is exact as kept (issue 27), so it keeps
    no copy and nothing is recomputed.
    """

    def __init__(self, weight: Weight, num_refined: int = 16, *, search: bool = True) -> None:
        super().__init__()
        stored = isinstance(weight, (Int4Levels, Int8Levels))
        self.linear = QuantLinear(weight, None, keep_dense=not stored, search=search)
        self.num_refined = 0 if self.linear.weight is None else min(num_refined, self.linear.out_features)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # Always the packed kernel: one row per sampled sequence, bits independent of the batch.
        logits = self.linear.packed_rows(hidden)  # [N, vocab] float32
        if not self.num_refined:
            return logits
        top = logits.topk(self.num_refined, dim=-1).indices  # [N, k]
        rows = self.linear.weight[top].float()  # [N, k, hidden]
        exact = (rows * hidden.float().unsqueeze(1)).sum(-1)  # per row: the same bits in any batch
        return logits.scatter_(1, top, exact)


class QuantEmbedding(nn.Module):
    """An embedding table stored in a 4-bit type, kept as its levels (two a byte) and each group's
    step and low: a looked-up row is the float32 row the file dequantizes to, at a sixth of the
    memory of the float table (Qwen2.5-Coder-1.5B's 151,936 x 1,536 table: 0.17 GiB, not 0.87)."""

    def __init__(self, levels: Int4Levels) -> None:
        super().__init__()
        q = levels.q
        self.register_buffer("packed", (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous())  # [V, K / 2]
        self.register_buffer("step", levels.step.contiguous())
        self.register_buffer("low", levels.low.contiguous())
        self.num_embeddings, self.embedding_dim = q.shape

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        packed = self.packed[input_ids]
        q = torch.stack((packed & 0x0F, packed >> 4), dim=-1).view(*input_ids.shape, -1, INT4_GROUP).float()
        return (self.low[input_ids][..., None] + q * self.step[input_ids][..., None]).flatten(-2)


class CodesEmbedding(nn.Module):
    """An embedding table stored as int8 codes with a scale (and low) per group (issue 42: Q8_0, Q6_K, Q5_K,
    IQ4_XS, ... `Int8Levels`), kept as stored: a looked-up row is the float32 row the file dequantizes to, at a
    quarter of the float table's memory or less (Qwen2.5-1.5B's 151,936 x 1,536 table in Q6_K: 0.29 GiB, not 0.87)."""

    def __init__(self, levels: Int8Levels) -> None:
        super().__init__()
        self.register_buffer("codes", levels.codes.contiguous())  # [V, K]
        self.register_buffer("scale", levels.scale.contiguous())  # [V, K / group]
        self.register_buffer("low", None if levels.low is None else levels.low.contiguous())
        self.num_embeddings, self.embedding_dim = levels.codes.shape

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        groups = self.scale.shape[1]
        codes = self.codes[input_ids].view(*input_ids.shape, groups, -1).float()
        rows = codes * self.scale[input_ids][..., None]  # Int8Levels.dequantize's operations, in its order
        return (rows if self.low is None else rows + self.low[input_ids][..., None]).flatten(-2)


class TiedQuantEmbedding(QuantEmbedding):
    """A tied embedding table read from the output head's own 4-bit blocks (`int4_blocks`' layout, scales in
    its float16 or float32 form): the table is kept once, not as the head's blocks plus a second packed copy
    (issue 42: an MLX 4-bit folder with tied embeddings then stays near its file size). A looked-up row is
    the same float32 row `QuantEmbedding` gives."""

    def __init__(self, head: QuantLinear) -> None:
        nn.Module.__init__(self)  # no tables of its own (QuantEmbedding's are the head's, read in place)
        self._head = [head]  # a list: the head's buffers stay registered once, on the head
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    @staticmethod
    def can_read(head: QuantLinear) -> bool:
        return head.int4_kernel and head.scale.dtype in (torch.float16, torch.float32)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        head = self._head[0]
        ids = input_ids.reshape(-1)
        block, row = ids // INT4_BLOCK, ids % INT4_BLOCK
        groups = self.embedding_dim // INT4_GROUP
        packed = head.qweight.view(-1, groups, 4, INT4_BLOCK, 4)[block, :, :, row, :]  # [n, group, v, t]
        q = torch.stack((packed & 0x0F, packed >> 4), dim=2).view(-1, groups, INT4_GROUP).float()  # [n, group, 32]
        scales = head.scale[block, :, :, row].float()  # [n, group, 2]: step, low
        rows = scales[..., 1:2] + q * scales[..., 0:1]
        return rows.view(*input_ids.shape, self.embedding_dim)


class TiedDenseEmbedding(nn.Module):
    """A tied float embedding table read from the output head's bfloat16 copy (`QuantHead` keeps one to recompute
    its top candidates) where that copy is the table exactly (a bfloat16 checkpoint: GPTQ, AWQ, compressed-tensors,
    FP8 folders keep the table unquantized): issue 42, the table is kept once, not also as a float32 table."""

    def __init__(self, head: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self._head = [head]  # a list: the head's buffers stay registered once, on the head
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    @staticmethod
    def can_read(head: QuantLinear, table: torch.Tensor) -> bool:
        copy = head.weight
        return copy is not None and copy.dtype == torch.bfloat16 and bool(torch.equal(copy.to(table.dtype), table))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._head[0].weight[input_ids].to(self.dtype)


# Sibling linears that read the same input in every family here; each group becomes one matmul.
FUSABLE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedQuantLinear(nn.Module):
    """Several linears over one input computed as a single matmul: quantized (CPU decode rewrite)
    or in the weights' own dtype (`fuse_projections`, the GPU path: fewer, larger GEMMs a step).

    The model still calls each projection by its own name: `FusedOutput` modules stand in
    for them and return their slice of the fused result, computed once per input tensor.
    """

    def __init__(self, linear: nn.Module, sizes: list[int]) -> None:
        """`linear`: the linears' weights stacked along the outputs; `sizes`: each one's number of outputs."""
        super().__init__()
        self.linear = linear
        self.sizes = sizes
        # [(input, its split outputs)]: a list, as nn.Module attribute writes cost ~7 us each; one
        # tuple, written and read whole, as two engines over one model may run it on two threads
        self._last: list[tuple[torch.Tensor | None, tuple[torch.Tensor, ...]]] = [(None, ())]

    @classmethod
    def of(cls, linears: list[nn.Linear], *, quantized: bool = True) -> FusedQuantLinear:
        return cls(_stacked(linears, quantized=quantized), [lin.out_features for lin in linears])

    def outputs(self, x: torch.Tensor, step: Step | None) -> tuple[torch.Tensor, ...]:
        return linear(self.linear, x, step).split(self.sizes, dim=-1)

    def output(self, x: torch.Tensor, index: int, step: Step | None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # Traced: the repeated matmul on the same input is one node after the compiler's CSE,
            # and a memo would put guards on its identity.
            return self.outputs(x, step)[index]
        last_input, outputs = self._last[0]
        if x is not last_input:
            outputs = self.outputs(x, step)
            self._last[0] = (x, outputs)
        return outputs[index]


def _stacked(linears: list[nn.Linear], *, quantized: bool) -> nn.Module:
    """One linear with the outputs of `linears` (of one input) stacked: quantized, or in their dtype."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = _cat_biases([lin.bias for lin in linears])
    return QuantLinear(weight, bias) if quantized else _plain_linear(weight, bias)


def _cat_biases(biases: list[torch.Tensor | None]) -> torch.Tensor | None:
    return torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None  # type: ignore[union-attr]


def _cat_weights(weights: list[Weight]) -> Weight:
    """Weights stacked along the outputs: levels stay levels when every part has them."""
    if len(weights) == 1:
        return weights[0]
    if all(isinstance(w, Int4Levels) for w in weights):
        return Int4Levels.cat(weights)  # type: ignore[arg-type]
    if all(isinstance(w, (Int4Levels, Int8Levels)) for w in weights):
        # Issue 27: mixed stored types (Qwen's Q4_K q/k with a Q6_K v) as int8 codes with scales and
        # lows per group: no rounding of either.
        return Int8Levels.cat(weights)  # type: ignore[arg-type]
    return torch.cat([w.dequantize() if isinstance(w, (Int4Levels, Int8Levels)) else w.detach().float()
                      for w in weights])


def _plain_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


def linear(projection: nn.Module, x: torch.Tensor, step: Step | None) -> torch.Tensor:
    """`projection(x)` as part of `step`: the rewritten projections (quantized, fused, LoRA) take the
    step, which picks each row's kernel; a plain nn.Linear has only one."""
    return projection(x) if isinstance(projection, nn.Linear) else projection(x, step)


def project(module: nn.Module, x: torch.Tensor, names: tuple[str, ...], step: Step | None) -> tuple[torch.Tensor, ...]:
    """The outputs of `module`'s projections `names` over one input, as part of `step`: one matmul,
    split, where they were fused in that order; else each projection on its own.

    NOTE: the families call this rather than each projection: traced (the compiled decode step),
    three calls of a fused projection were three matmuls, as the compiler does not merge the
    repeated quantized kernels (1.8x the weight bytes read a layer).
    """
    first = getattr(module, names[0])
    if isinstance(first, FusedOutput) and first.index == 0 and len(first._fused[0].sizes) == len(names):
        return first._fused[0].outputs(x, step)
    return tuple(linear(getattr(module, name), x, step) for name in names)


QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


class FusedOutput(nn.Module):
    def __init__(self, fused: FusedQuantLinear, index: int) -> None:
        super().__init__()
        self._fused = [fused]  # a list: the group is registered once, on the parent
        self.index = index

    def forward(self, x: torch.Tensor, step: Step | None = None) -> torch.Tensor:
        return self._fused[0].output(x, self.index, step)


def _fuse_groups(parent: nn.Module, build: Callable[[list[nn.Linear], tuple[str, ...]], nn.Module | None]) -> int:
    """Each group of sibling linears becomes one `build(linears, names)`, which the names then slice (a group
    whose `build` gives None stays as it is)."""
    count = 0
    for names in FUSABLE_GROUPS:
        linears = [getattr(parent, n, None) for n in names]
        if not all(isinstance(lin, nn.Linear) for lin in linears):
            continue
        stacked = build(linears, names)  # type: ignore[arg-type]
        if stacked is None:
            continue
        fused = FusedQuantLinear(stacked, [lin.out_features for lin in linears])  # type: ignore[union-attr]
        parent.add_module("fused_" + "_".join(n.split("_")[0] for n in names), fused)
        for index, name in enumerate(names):
            setattr(parent, name, FusedOutput(fused, index))
        count += len(names)
    return count


def can_quantize() -> bool:
    """Whether this torch build has the int8 weight-only CPU kernel (the 4-bit one is optional)."""
    try:
        x = torch.zeros(1, 32, dtype=torch.bfloat16)
        torch.ops.aten._weight_int8pack_mm(x, torch.zeros(32, 32, dtype=torch.int8), torch.ones(32, dtype=torch.bfloat16))
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


@functools.cache
def can_pack_int4() -> bool:
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.zeros(32, 64, dtype=torch.int32), 2)
        scales = torch.ones(64 // INT4_GROUP, 32, 2, dtype=torch.bfloat16)
        torch.ops.aten._weight_int4pack_mm_for_cpu(torch.zeros(1, 64, dtype=torch.bfloat16), packed, INT4_GROUP, scales)
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def quantize(model: nn.Module) -> QuantSummary:
    """Replace every nn.Linear (and a tied output head) in place; says how many went 4-bit and 8-bit.

    One linear at a time, each read from the checkpoint as it is packed where the model is still
    lazy (`_Checkpoint`): the load never holds more than one float weight beyond the packed model."""
    checkpoint = _Checkpoint(model)
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    embed_levels = checkpoint.levels("model.embed_tokens") if isinstance(embed, nn.Embedding) else None
    # Issue 42: a table stored as int8 codes (Q8_0, Q6_K, IQ4_XS, ...) stays codes too, not a float table.
    embed_codes = checkpoint.codes("model.embed_tokens") if isinstance(embed, nn.Embedding) and embed_levels is None else None
    if isinstance(head, nn.Linear):
        model.lm_head = QuantHead(checkpoint.weight("lm_head", head), search=checkpoint.search)
        checkpoint.replaced("lm_head")
    elif head is None and isinstance(embed, nn.Embedding):
        # Tied output head: the largest matmul of a decode step, quantized like the rest, from the file's
        # levels or int8 codes where it stores them (Q8_0: SmolLM2's table), not a second rounding of the
        # floats; a float table stays the embedding, read in place, once.
        weight: Weight | None = embed_levels if embed_levels is not None else embed_codes
        if weight is None:
            weight = checkpoint.kept("model.embed_tokens", embed).weight
        model.lm_head = QuantHead(weight, search=checkpoint.search)
        if isinstance(weight, torch.Tensor) and TiedDenseEmbedding.can_read(model.lm_head.linear, weight.detach()):
            model.model.embed_tokens = TiedDenseEmbedding(model.lm_head.linear, weight.dtype)
        del weight
    if embed_levels is not None or embed_codes is not None:
        tied = embed_levels is not None and head is None and TiedQuantEmbedding.can_read(model.lm_head.linear)
        model.model.embed_tokens = (TiedQuantEmbedding(model.lm_head.linear) if tied
                                    else QuantEmbedding(embed_levels) if embed_levels is not None
                                    else CodesEmbedding(embed_codes))  # type: ignore[arg-type]
        checkpoint.replaced("model.embed_tokens")
    del embed_levels, embed_codes
    for prefix, parent in list(model.named_modules()):
        _fuse_groups(parent, lambda linears, names: checkpoint.linear([_join(prefix, n) for n in names], linears))
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, checkpoint.linear([_join(prefix, name)], [child]))
            elif callable(getattr(child, "packed", None)):  # stacked weights that pack themselves (MoE experts)
                setattr(parent, name, child.packed(StoredSource(checkpoint, _join(prefix, name), child)))
                checkpoint.replaced(_join(prefix, name))
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    kinds = [m.bits for m in linears]
    return QuantSummary(num_int4=kinds.count(4), num_int8=kinds.count(8),
                        num_kept_once=sum(m.weight is None for m in linears))


def resident_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers (each storage once; meta tensors, not yet read, count 0):
    the weights as kept in memory (issue 42: /props, /v1/models and the startup log)."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.is_meta:
            continue
        storage = tensor.untyped_storage()
        seen[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def fuse_projections(model: nn.Module) -> int:
    """Unquantized models (the GPU path): q/k/v and gate/up become one matmul each, in the
    weights' own dtype; returns how many linears were fused. Each weight is still kept once."""
    return sum(_fuse_groups(parent, lambda linears, names: _stacked(linears, quantized=False))
               for parent in list(model.modules()))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class _Checkpoint:
    """How `quantize` reads the linears it replaces: the levels a 4-bit GGUF stores where it has
    them (`model.packed_weights`), else the parameter, read from the checkpoint now if the model is
    still lazy (`model.lazy_weights`, loading/lazy.py) and not kept."""

    def __init__(self, model: nn.Module) -> None:
        self.packed: PackedWeights | None = getattr(model, "packed_weights", None)
        self.lazy = getattr(model, "lazy_weights", None)
        self.search = self.packed is None  # a GGUF names each tensor's type: no grid to look for

    def levels(self, prefix: str) -> Int4Levels | None:
        return self.packed.int4_levels(f"{prefix}.weight") if self.packed is not None else None

    def codes(self, prefix: str) -> Int8Levels | None:
        reader = getattr(self.packed, "int8_levels", None)
        return reader(f"{prefix}.weight") if reader is not None else None

    def weight(self, prefix: str, module: nn.Module) -> Weight:
        stored = self.levels(prefix)
        stored = stored if stored is not None else self.codes(prefix)
        return stored if stored is not None else self.param(prefix, module, "weight")  # type: ignore[return-value]

    def kept(self, prefix: str, module: nn.Module) -> nn.Module:
        """`module`, which stays in the model, with its parameters read in place."""
        if self.lazy is not None:
            self.lazy.materialize(prefix)
        return module

    def param(self, prefix: str, module: nn.Module, name: str) -> torch.Tensor | None:
        value = getattr(module, name)
        if value is not None and value.is_meta and self.lazy is not None:
            return self.lazy.read(f"{prefix}.{name}")
        return value

    def linear(self, prefixes: list[str], linears: list[nn.Linear]) -> QuantLinear:
        """The linears at `prefixes` as one QuantLinear (their outputs stacked); they are then forgotten."""
        weight = _cat_weights([self.weight(p, lin) for p, lin in zip(prefixes, linears)])
        bias = _cat_biases([self.param(p, lin, "bias") for p, lin in zip(prefixes, linears)])
        quantized = QuantLinear(weight, bias, search=self.search)
        for prefix in prefixes:
            self.replaced(prefix)
        return quantized

    def replaced(self, prefix: str) -> None:
        if self.lazy is not None:
            self.lazy.forget(prefix)


@dataclass(frozen=True)
class StoredSource:
    """What a module that packs its own stacked weights (layers/moe.py `Experts.packed`) reads through
    `quantize`: the checkpoint's stored levels or codes of a tensor under its prefix, its float
    parameters (read now where the model is lazy), and the packing of one linear."""

    checkpoint: _Checkpoint
    prefix: str
    module: nn.Module

    def stored(self, name: str) -> Int4Levels | Int8Levels | None:
        full = f"{self.prefix}.{name}"
        levels = self.checkpoint.packed.int4_levels(full) if self.checkpoint.packed is not None else None
        reader = getattr(self.checkpoint.packed, "int8_levels", None)
        return levels if levels is not None or reader is None else reader(full)

    def param(self, name: str) -> torch.Tensor | None:
        return self.checkpoint.param(self.prefix, self.module, name)

    def pack(self, weights: list[Weight], bias: torch.Tensor | None) -> QuantLinear:
        """One linear of these outputs stacked (stored parts stay stored), every row on the packed kernel."""
        return QuantLinear(_cat_weights(weights), bias, search=self.checkpoint.search, packed_only=True)


@dataclass(frozen=True, slots=True)
class QuantSummary:
    num_int4: int
    num_int8: int
    num_kept_once: int = 0  # 4-bit ones on our kernel: no bfloat16 copy, prefill rows take it too

    def __str__(self) -> str:
        return (f"{self.num_int4} 4-bit and {self.num_int8} int8 weight-only matmuls for decode rows "
                f"(4-bit where the checkpoint's weights are 4-bit); prefill rows: the 4-bit kernel for "
                f"{self.num_kept_once} of them (their weights kept once, packed), bfloat16 for the rest")
