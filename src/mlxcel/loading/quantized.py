"""Quantized safetensors checkpoints (issue 42): MLX affine, GPTQ, AWQ, compressed-tensors, block FP8, and
gpt-oss's MXFP4 experts (issue 40).

`quant_format` reads the format from config.json (`quantization`: MLX; `quantization_config` with
`quant_method` gptq / awq / compressed-tensors / fp8 / mxfp4) and refuses, in one line naming it, a form that
cannot be served, before any weight is read. `QuantizedFolder` then gives the loader two views of the
same tensors:
- readers: each linear's `weight` dequantized to float32 (the GPU path, which serves bfloat16, and any
  weight the CPU rewrite does not take as stored), under the names the model has (the packed tensors,
  scales, zeros and activation scales are not parameters);
- `layers.quant.PackedWeights`: the stored codes as `Int4Levels` (4-bit and narrower integer codes:
  w = low + q * step per group) or `Int8Levels` (wider codes, MLX mxfp4/nvfp4 doubled to integers),
  which the CPU decode rewrite packs for its int4 / int8 kernels without rounding them again.

NOTE: the int4 kernel scales groups of 32 inputs; a group of 64 or 128 is kept as its steps and lows
repeated for each 32 (exact; 0.125 byte a weight of float16 scales, not 0.0625 or 0.03). FP8 weights
have no integer grid: on the CPU they are dequantized and rounded per output channel to int8 (one byte a
weight, as in the file), activations stay float (no FP8 activation rounding). On CUDA, 4-bit levels and FP8 weights
scaled per tensor or channel (`fp8_weight`) stay as stored (layers/quant_cuda.py); the rest is dequantized to
bfloat16.

MXFP4 (`quant_method: mxfp4`, the released openai/gpt-oss-20b / 120b): only the expert stacks are quantized,
each `{stem}_blocks` (uint8 [E, rows, K / 32, 16], two E2M1 codes a byte, the low nibble first) with
`{stem}_scales` (uint8 E8M0 exponents [E, rows, K / 32]: 2^(s - 127)); the float view is transformers'
`convert_moe_packed_tensors` (the checkpoint's own [E, K, rows] x @ W layout). The codes are offered as
llama.cpp's converter splits them (`gate_proj` / `up_proj` / `down_proj`, gate the even rows of gate_up,
up the odd ones), which `layers.moe.Experts.packed` reads: E2M1 doubled (-12..12) with the scale halved,
exact, as GGUF MXFP4 is read.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from mlxcel.layers.quant import INT4_GROUP, Int4Levels, Int8Levels
from mlxcel.layers.quant_cuda import Fp8Weight
from mlxcel.loading.errors import ModelLoadError

log = logging.getLogger(__name__)

Reader = Callable[[str], torch.Tensor]

MLX_BITS = (2, 3, 4, 5, 6, 8)
MLX_GROUPS = (32, 64, 128)
# MLX's 4-bit floating-point modes: E2M1 codes with a power-of-two (mx) or E4M3 (nv) scale per group.
# (mxfp8, E4M3 codes, is refused: no integer form, and no widened path yet.)
MLX_FLOAT_MODES = {"mxfp4": (4, 32), "nvfp4": (4, 16)}
# Tensors of a quantized linear that are not model parameters (activation and KV scales included).
AUX_SUFFIXES = ("scales", "biases", "qweight", "qzeros", "g_idx", "weight_scale", "weight_scale_inv",
                "weight_zero_point", "weight_shape", "weight_g_idx", "weight_packed", "weight_global_scale",
                "input_scale", "input_zero_point", "input_global_scale", "output_scale", "k_scale", "v_scale")
MXFP4_GROUP = 32  # weights an E8M0 scale
MXFP4_SPLIT = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None)}
_ROWS = 1024  # rows unpacked at a time: the int64 temporaries stay a slice's size
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # AutoAWQ's GEMM kernel's nibble order within a word


@dataclass(frozen=True)
class QuantFormat:
    """What config.json says of a quantized checkpoint: `method` (mlx, gptq, awq, compressed-tensors,
    fp8), the weights' bits and group size (0: per output channel, -1: blocks), and the raw block."""

    method: str
    bits: int
    group_size: int
    mode: str = "affine"  # MLX: affine | mxfp4 | nvfp4 | mxfp8; compressed-tensors: its `format`
    settings: dict[str, Any] = field(default_factory=dict, compare=False)

    def describe(self) -> str:
        group = ("per channel" if self.group_size == 0 else "blocks " + "x".join(map(str, self.settings.get(
            "weight_block_size", ()))) if self.group_size < 0 else f"groups of {self.group_size}")
        name = {"mlx": f"MLX {self.mode}", "gptq": "GPTQ", "awq": "AWQ (GEMM)", "fp8": "FP8 (e4m3)",
                "compressed-tensors": f"compressed-tensors {self.mode}",
                "mxfp4": "MXFP4 (E2M1, E8M0 scales) experts"}[self.method]
        return f"{name} {self.bits}-bit, {group}"


def quant_format(config: dict[str, Any]) -> QuantFormat | None:
    """The checkpoint's quantization from its config.json (None: float weights); a ModelLoadError of one
    line naming the format when it cannot be served."""
    mlx = config.get("quantization")
    block = config.get("quantization_config")
    if isinstance(mlx, dict) or (isinstance(block, dict) and "quant_method" not in block and "bits" in block):
        return _mlx_format(mlx if isinstance(mlx, dict) else block)
    if not isinstance(block, dict):
        return None
    method = str(block.get("quant_method", "")).lower()
    readers = {"gptq": _gptq_format, "awq": _awq_format, "compressed-tensors": _compressed_format,
               "fp8": _fp8_format, "mxfp4": _mxfp4_format}
    if method not in readers:
        raise ModelLoadError(f"quantization {method or 'without a quant_method'!r} is not supported "
                             f"(served: MLX affine, gptq, awq, compressed-tensors, fp8, mxfp4)")
    return readers[method](block)


def _mlx_format(block: dict[str, Any]) -> QuantFormat:
    mode = str(block.get("mode", "affine"))
    bits, group = block.get("bits"), block.get("group_size", 64)
    if mode in MLX_FLOAT_MODES and (bits, group) == MLX_FLOAT_MODES[mode]:
        return QuantFormat("mlx", bits, group, mode, block)
    if mode != "affine":
        raise ModelLoadError(f"MLX quantization mode {mode!r} with {bits} bits in groups of {group} is not "
                             f"supported (affine, mxfp4 and nvfp4 are)")
    if bits not in MLX_BITS or group not in MLX_GROUPS:
        raise ModelLoadError(f"MLX affine quantization with {bits} bits in groups of {group} is not supported "
                             f"(bits {MLX_BITS}, groups {MLX_GROUPS})")
    return QuantFormat("mlx", int(bits), int(group), mode, block)


def _gptq_format(block: dict[str, Any]) -> QuantFormat:
    bits, group = block.get("bits"), int(block.get("group_size", 128))
    checkpoint_format = str(block.get("checkpoint_format", "gptq")).lower()
    if bits not in (4, 8) or checkpoint_format not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"GPTQ with {bits} bits (checkpoint format {checkpoint_format!r}) is not supported "
                             f"(4 and 8 bits, formats gptq and gptq_v2)")
    return QuantFormat("gptq", bits, max(group, 0), checkpoint_format, block)


def _awq_format(block: dict[str, Any]) -> QuantFormat:
    bits, version = block.get("bits", block.get("w_bit")), str(block.get("version", "gemm")).lower()
    group = int(block.get("group_size", block.get("q_group_size", 128)))
    if bits != 4 or version != "gemm":
        raise ModelLoadError(f"AWQ {version} with {bits} bits is not supported (4-bit GEMM packing is)")
    return QuantFormat("awq", 4, max(group, 0), version, block)


def _compressed_format(block: dict[str, Any]) -> QuantFormat:
    fmt = str(block.get("format", ""))
    groups = [g.get("weights") or {} for g in (block.get("config_groups") or {}).values()]
    if fmt not in ("pack-quantized", "float-quantized", "naive-quantized", "int-quantized") or not groups:
        raise ModelLoadError(f"compressed-tensors format {fmt!r} is not supported "
                             f"(pack-quantized, float-quantized, naive-quantized, int-quantized)")
    weights = groups[0]
    kind, bits = weights.get("type", "int"), int(weights.get("num_bits", 0))
    if kind == "float" and bits != 8 or kind == "int" and not 2 <= bits <= 8:
        raise ModelLoadError(f"compressed-tensors {fmt} {kind} {bits}-bit weights are not supported "
                             f"(int 2-8 bit, float 8-bit)")
    strategy = weights.get("strategy", "tensor")
    group = int(weights.get("group_size") or 0) if strategy == "group" else -1 if strategy == "block" else 0
    settings = {**block, "weight_block_size": weights.get("block_structure") or ()}
    return QuantFormat("compressed-tensors", bits, group, fmt, settings)


def _fp8_format(block: dict[str, Any]) -> QuantFormat:
    fmt = str(block.get("fmt", "e4m3"))
    if fmt != "e4m3":
        raise ModelLoadError(f"FP8 format {fmt!r} is not supported (e4m3 is)")
    return QuantFormat("fp8", 8, -1 if block.get("weight_block_size") else 0, fmt, block)


def _mxfp4_format(block: dict[str, Any]) -> QuantFormat:
    return QuantFormat("mxfp4", 4, MXFP4_GROUP, "e2m1", block)


# ---- unpacking ----------------------------------------------------------------------------------

def unpack_rows(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Each row of 32-bit words [R, W] read as a little-endian stream of `bits`-bit fields, first field in the
    lowest bits (MLX, GPTQ after a transpose, compressed-tensors): uint8 [R, count] (count a multiple of 8)."""
    rows = packed.shape[0]
    data = packed.contiguous().view(torch.int32).view(torch.uint8).view(rows, -1)[:, :count * bits // 8]
    if bits == 8:
        return data.clone()
    out = torch.empty(rows, count, dtype=torch.uint8)
    if 8 % bits == 0:  # 2 and 4 bits: whole fields in each byte, shifted in uint8 (no int64 words)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
        for start in range(0, rows, _ROWS):
            part = data[start:start + _ROWS].unsqueeze(-1) >> shifts  # [rows, bytes, fields a byte]
            out[start:start + _ROWS] = part.bitwise_and_((1 << bits) - 1).view(-1, count)
        return out
    byte_shifts = torch.arange(bits, dtype=torch.int64) * 8
    field_shifts = torch.arange(8, dtype=torch.int64) * bits
    for start in range(0, rows, _ROWS):
        part = data[start:start + _ROWS].to(torch.int64).view(-1, count // 8, bits)
        words = (part << byte_shifts).sum(-1, keepdim=True)  # 8 fields in `bits` bytes: at most 64 bits
        out[start:start + _ROWS] = ((words >> field_shifts) & ((1 << bits) - 1)).view(-1, count).to(torch.uint8)
    return out


def _repeat_groups(values: torch.Tensor, k: int) -> torch.Tensor:
    """Per-group values [N, G] -> one per input [N, K]."""
    return values.repeat_interleave(k // values.shape[1], dim=1)


def affine_levels(q: torch.Tensor, step: torch.Tensor, low: torch.Tensor, bits: int) -> Int4Levels | Int8Levels:
    """Integer codes q [N, K] (0 .. 2^bits - 1) with w = low + q * step per group (step, low [N, G]) as the
    kernels keep them: 4 bits and fewer as `Int4Levels` (groups of 32: a wider group's step and low repeated);
    more as signed `Int8Levels` codes q - 2^(bits-1) with the low moved to match (exact in float32)."""
    n, k = q.shape
    group = k // step.shape[1]
    step, low = step.float(), low.float()
    if bits <= 4 and group % INT4_GROUP == 0:
        times = group // INT4_GROUP
        return Int4Levels(q.to(torch.uint8), step.repeat_interleave(times, 1), low.repeat_interleave(times, 1))
    offset = 1 << (bits - 1) if bits > 4 else 0
    codes = (q.to(torch.int16) - offset).to(torch.int8)
    low = low + offset * step
    return Int8Levels(codes, step, None if not bool(low.any()) else low)


# FP4 E2M1 values times two (integers), by code: MLX's mxfp4 / nvfp4 elements.
_E2M1_TWICE = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8)


class QuantizedFolder:
    """A quantized safetensors folder: float readers for every parameter and the stored codes of each
    quantized linear (`layers.quant.PackedWeights`, set on the model as `model.packed_weights`)."""

    def __init__(self, model_dir: Path, fmt: QuantFormat) -> None:
        from safetensors import safe_open

        self.fmt = fmt
        self.tensors: dict[str, Any] = {}  # name -> its file's handle
        self.pages = MappedPages()
        self.file_bytes = 0
        for file in sorted(model_dir.glob("*.safetensors")):
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as exc:  # noqa: BLE001 - safetensors raises several kinds
                raise ModelLoadError(f"{file}: cannot read safetensors weights ({exc})") from exc
            self.file_bytes += file.stat().st_size
            self.tensors.update(dict.fromkeys(handle.keys(), handle))
            self.pages.files[id(handle)] = str(file.resolve())
        if not self.tensors:
            raise ModelLoadError(f"{model_dir}: no *.safetensors weights found")
        self.linears = {stem for name in self.tensors if (stem := self._quantized_stem(name)) is not None}
        if not self.linears:
            raise ModelLoadError(f"{model_dir}: config.json says {fmt.describe()}, but no tensor is stored so")

    def _quantized_stem(self, name: str) -> str | None:
        """The linear `name` is the stored weight of, where it is stored quantized."""
        if self.fmt.method == "mxfp4":
            return name.removesuffix("_blocks") if name.endswith("_blocks") else None
        stem, _, kind = name.rpartition(".")
        marker = {"mlx": "scales", "gptq": "qweight", "awq": "qweight"}.get(self.fmt.method)
        if marker is not None:
            return stem if kind == marker else None
        if kind == "weight_packed" or kind in ("weight_scale", "weight_scale_inv") and f"{stem}.weight" in self.tensors:
            return stem
        return None

    def get(self, name: str) -> torch.Tensor:
        handle = self.tensors[name]
        return self.pages.touched(handle.get_tensor(name), id(handle))

    def has(self, name: str) -> bool:
        return name in self.tensors

    # ---- the loader's views ----

    def readers(self) -> dict[str, Reader]:
        """Parameter name -> its float tensor (quantized linears dequantized to float32)."""
        readers: dict[str, Reader] = {}
        for name in self.tensors:
            if self.fmt.method == "mxfp4" and (stacked := _mxfp4_stem(name)) in self.linears:
                readers[stacked] = self._mxfp4_float  # blocks and scales: one float expert stack
                continue
            stem, _, kind = name.rpartition(".")
            if stem in self.linears:
                if kind in AUX_SUFFIXES or kind == "weight":
                    readers[f"{stem}.weight"] = self._dequantized
                    continue
            if kind in AUX_SUFFIXES and kind not in ("scales", "biases"):
                continue  # activation / KV scales of a float linear: not parameters here
            readers[name] = self._plain
        # Each bound to its own name: a family's sanitize may rename the entry (gpt-oss's router -> gate).
        return {name: _bound(read, name) for name, read in readers.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: read(name) for name, read in self.readers().items()}

    def _plain(self, name: str) -> torch.Tensor:
        return self.get(name)

    def _dequantized(self, name: str) -> torch.Tensor:
        stem = name.removesuffix(".weight")
        levels = self.levels(stem)
        if levels is not None:
            return levels.dequantize()
        with self.pages.released():
            return self._float_weight(stem)

    def int4_levels(self, name: str) -> Int4Levels | None:
        levels = self.levels(name.removesuffix(".weight")) if name.endswith(".weight") else None
        return levels if isinstance(levels, Int4Levels) else None

    def int8_levels(self, name: str) -> Int8Levels | None:
        if self.fmt.method == "mxfp4":
            return self._mxfp4_levels(name)
        levels = self.levels(name.removesuffix(".weight")) if name.endswith(".weight") else None
        return levels if isinstance(levels, Int8Levels) else None

    def fp8_weight(self, name: str) -> Fp8Weight | None:
        """Parameter `name`'s stored e4m3 weight and its scale per output channel, where the file scales it per
        tensor or per channel (the CUDA `_scaled_mm` path, layers/quant_cuda.py); None otherwise (block scales too)."""
        stem = name.removesuffix(".weight")
        if not name.endswith(".weight") or stem not in self.linears or self._dtype(name) != "F8_E4M3":
            return None
        scale_name = f"{stem}.weight_scale_inv" if self.has(f"{stem}.weight_scale_inv") else f"{stem}.weight_scale"
        if not self.has(scale_name):
            return None
        weight, scale = self.get(name), self.get(scale_name).float()
        n = weight.shape[0]
        if scale.numel() == 1:
            return Fp8Weight(weight, scale.reshape(1).expand(n).contiguous())
        if scale.numel() == n and (scale.dim() < 2 or scale.shape[-1] == 1):
            return Fp8Weight(weight, scale.reshape(n).contiguous())
        return None

    def levels(self, stem: str) -> Int4Levels | Int8Levels | None:
        """Linear `stem`'s stored integer codes (None: not quantized, or FP8, which has no integer grid)."""
        if stem not in self.linears:
            return None
        with self.pages.released():
            return self._levels(stem)

    def _levels(self, stem: str) -> Int4Levels | Int8Levels | None:
        method = self.fmt.method
        if method == "mlx":
            return self._mlx(stem)
        if method in ("gptq", "awq"):
            return self._gptq(stem) if method == "gptq" else self._awq(stem)
        if self.has(f"{stem}.weight_packed") or self._dtype(f"{stem}.weight") == "I8":
            return self._compressed(stem)
        return None  # FP8

    def _dtype(self, name: str) -> str | None:
        """A stored tensor's safetensors dtype ("I8", "F8_E4M3", ...) without reading it."""
        return self.tensors[name].get_slice(name).get_dtype() if name in self.tensors else None

    # ---- MLX ----

    def _mlx_layer(self, stem: str) -> tuple[int, int, str]:
        """Bits, group size and mode of one MLX linear: the file's defaults or its per-layer override."""
        block = self.fmt.settings
        override = block.get(stem)
        if isinstance(override, dict):
            return int(override.get("bits", self.fmt.bits)), int(override.get("group_size", self.fmt.group_size)), \
                str(override.get("mode", self.fmt.mode))
        return self.fmt.bits, self.fmt.group_size, self.fmt.mode

    def _mlx(self, stem: str) -> Int4Levels | Int8Levels:
        bits, group, mode = self._mlx_layer(stem)
        packed, scales = self.get(f"{stem}.weight"), self.get(f"{stem}.scales")
        k = packed.shape[1] * 32 // bits
        if scales.shape[1] * group != k or packed.dim() != 2:
            raise ModelLoadError(f"{stem}: MLX tensors {tuple(packed.shape)} / scales {tuple(scales.shape)} do not "
                                 f"fit {bits}-bit codes in groups of {group}")
        q = unpack_rows(packed, bits, k)
        if mode == "affine":
            return affine_levels(q, scales, self.get(f"{stem}.biases"), bits)
        return _mlx_float_levels(q, scales, mode)

    # ---- GPTQ / AWQ ----

    def _gptq(self, stem: str) -> Int4Levels | Int8Levels | None:
        bits = self.fmt.bits
        qweight, scales = self.get(f"{stem}.qweight"), self.get(f"{stem}.scales").float()  # [K*b/32, N], [G, N]
        n = qweight.shape[1]
        k = qweight.shape[0] * 32 // bits
        q = unpack_rows(qweight.t(), bits, k)  # [N, K]
        zeros = unpack_rows(self.get(f"{stem}.qzeros"), bits, n).t().float()  # [N, G]
        if self.fmt.mode == "gptq":  # v1 (AutoGPTQ) stores each zero less one
            zeros = (zeros + 1).remainder(1 << bits)
        scales = scales.t().contiguous()
        g_idx = self.get(f"{stem}.g_idx").long() if self.has(f"{stem}.g_idx") else None
        group = k // scales.shape[1]
        if g_idx is not None and not torch.equal(g_idx, torch.arange(k) // group):
            # desc_act: groups are not runs of inputs; no per-run scale exists, so the weight goes as floats
            # (the CPU rewrite rounds it per channel to int8).
            return None
        return affine_levels(q, scales, -scales * zeros, bits)

    def _awq(self, stem: str) -> Int4Levels:
        qweight, qzeros = self.get(f"{stem}.qweight"), self.get(f"{stem}.qzeros")  # [K, N/8], [G, N/8]
        scales = self.get(f"{stem}.scales").float()  # [G, N]
        n = qweight.shape[1] * 8
        order = torch.arange(n).view(-1, 8)[:, list(AWQ_REVERSE_ORDER)].reshape(-1)
        q = unpack_rows(qweight, 4, n)[:, order].t().contiguous()  # [N, K]
        zeros = unpack_rows(qzeros, 4, n)[:, order].t().float()  # [N, G]
        scales = scales.t().contiguous()
        return affine_levels(q, scales, -scales * zeros, 4)  # type: ignore[return-value]

    # ---- compressed-tensors ----

    def _compressed(self, stem: str) -> Int4Levels | Int8Levels | None:
        scale = self.get(f"{stem}.weight_scale").float()
        if self.has(f"{stem}.weight_packed"):
            packed = self.get(f"{stem}.weight_packed")
            n, k = (int(v) for v in self.get(f"{stem}.weight_shape"))
            bits = packed.shape[1] * 32 // k
            offset = 1 << (bits - 1)
            q = unpack_rows(packed, bits, k)
        else:  # naive / int-quantized: int8 codes as they are
            codes = self.get(f"{stem}.weight")
            (n, k), bits, offset = codes.shape, 8, 128
            q = (codes.to(torch.int16) + 128).to(torch.uint8)
        if self.has(f"{stem}.weight_g_idx"):
            g_idx = self.get(f"{stem}.weight_g_idx").long()
            if not torch.equal(g_idx, torch.arange(k) // (k // scale.shape[1])):
                return None  # activation order: as GPTQ's desc_act
        scale = scale.expand(n, -1) if scale.shape[0] == 1 else scale
        scale = scale.view(n, -1)
        zero = torch.full_like(scale, float(offset))
        if self.has(f"{stem}.weight_zero_point"):
            zp = self.get(f"{stem}.weight_zero_point")
            if zp.dtype == torch.int32:  # packed along the outputs
                zp = unpack_rows(zp.t().contiguous(), bits, -(-n // 8) * 8)[:, :n].t().to(torch.int16) - offset
            zero = zero + zp.float().view(n, -1)
        return affine_levels(q, scale, -scale * zero, bits)

    def _float_weight(self, stem: str) -> torch.Tensor:
        """An FP8 (or g_idx-ordered integer) linear's weight dequantized to float32."""
        method = self.fmt.method
        if method in ("gptq", "awq") or self.has(f"{stem}.weight_packed") or self.has(f"{stem}.weight_g_idx"):
            return self._reordered_float(stem)
        weight = self.get(f"{stem}.weight")
        scale_name = f"{stem}.weight_scale_inv" if self.has(f"{stem}.weight_scale_inv") else f"{stem}.weight_scale"
        return fp8_dequantize(weight, self.get(scale_name).float())

    def _reordered_float(self, stem: str) -> torch.Tensor:
        """A GPTQ / compressed-tensors weight whose groups follow `g_idx` (activation order): float32 [N, K]."""
        if self.fmt.method == "gptq":
            bits = self.fmt.bits
            qweight = self.get(f"{stem}.qweight")
            k = qweight.shape[0] * 32 // bits
            q = unpack_rows(qweight.t(), bits, k).float()
            zeros = unpack_rows(self.get(f"{stem}.qzeros"), bits, qweight.shape[1]).float()
            if self.fmt.mode == "gptq":
                zeros = (zeros + 1).remainder(1 << bits)
            scales, g_idx = self.get(f"{stem}.scales").float(), self.get(f"{stem}.g_idx").long()
            return (q - zeros[g_idx].t()) * scales[g_idx].t()
        packed, scale = self.get(f"{stem}.weight_packed"), self.get(f"{stem}.weight_scale").float()
        n, k = (int(v) for v in self.get(f"{stem}.weight_shape"))
        bits = packed.shape[1] * 32 // k
        q = unpack_rows(packed, bits, k).float() - (1 << (bits - 1))
        g_idx = self.get(f"{stem}.weight_g_idx").long()
        zero = torch.zeros_like(scale)
        if self.has(f"{stem}.weight_zero_point"):
            zp = self.get(f"{stem}.weight_zero_point")
            zero = (unpack_rows(zp.t().contiguous(), bits, -(-n // 8) * 8)[:, :n].t().float() - (1 << (bits - 1)))
        return (q - zero[:, g_idx]) * scale[:, g_idx]

    # ---- MXFP4 (gpt-oss) ----

    def _mxfp4_float(self, stem: str) -> torch.Tensor:
        """An expert stack as the unquantized checkpoint stores it: [E, K, rows] (x @ W), in bfloat16, which
        holds every E2M1 value times a power of two exactly (half the bytes of float32 while a load holds it)."""
        blocks, scales = self.get(f"{stem}_blocks"), self.get(f"{stem}_scales")
        num, rows, k = blocks.shape[0], blocks.shape[1], blocks.shape[2] * 32
        out = torch.empty(num, k, rows, dtype=torch.bfloat16)
        for e in range(num):  # one expert's float32 temporaries at a time
            out[e] = mxfp4_levels(blocks[e], scales[e]).dequantize().t()
        return out

    def _mxfp4_levels(self, name: str) -> Int8Levels | None:
        """`{prefix}.gate_proj.weight` / `up_proj` / `down_proj` (llama.cpp's split of the stacks): their
        codes and scales over every expert's rows [E * rows, K]."""
        prefix, _, part = name.removesuffix(".weight").rpartition(".")
        if not name.endswith(".weight") or part not in MXFP4_SPLIT:
            return None
        stem, parity = MXFP4_SPLIT[part]
        stem = f"{prefix}.{stem}"
        if stem not in self.linears:
            return None
        blocks, scales = self.get(f"{stem}_blocks"), self.get(f"{stem}_scales")
        if parity is not None:  # gpt-oss interleaves gate and up rows
            blocks, scales = blocks[:, parity::2], scales[:, parity::2]
        return mxfp4_levels(blocks, scales)

    def resident_summary(self) -> dict[str, Any]:
        return {"format": self.fmt.method, "description": self.fmt.describe(), "bits": self.fmt.bits,
                "group_size": self.fmt.group_size, "file_bytes": self.file_bytes}


def _bound(read: Reader, name: str) -> Reader:
    return lambda _name: read(name)


def _mxfp4_stem(name: str) -> str:
    return name.removesuffix("_blocks").removesuffix("_scales")


# Each byte's two E2M1 codes (low nibble first), doubled to int8: a byte -> its pair, without int64 temporaries.
_E2M1_PAIRS = torch.stack((_E2M1_TWICE[torch.arange(256) & 15], _E2M1_TWICE[torch.arange(256) >> 4]), dim=1)


def mxfp4_levels(blocks: torch.Tensor, scales: torch.Tensor) -> Int8Levels:
    """MXFP4 blocks (uint8 [..., G, 16]) and E8M0 scales (uint8 [..., G]) as exact int8 codes [rows, 32 G]
    (E2M1 doubled) with float32 scales [rows, G] halved: 2^(s - 128)."""
    rows, groups = scales.numel() // scales.shape[-1], scales.shape[-1]
    packed = blocks.reshape(rows, groups * 16)
    codes = torch.empty(rows, groups * 32, dtype=torch.int8)
    for start in range(0, rows, _ROWS):
        codes[start:start + _ROWS] = _E2M1_PAIRS[packed[start:start + _ROWS].int()].view(-1, groups * 32)
    return Int8Levels(codes, torch.exp2(scales.reshape(rows, groups).float() - 128), None)


class MappedPages:
    """The pages of the mapped safetensors files that reading a linear's tensors touched, let go once its codes
    are unpacked (issue 42): the tensors `safe_open` gives are views of the file's mapping, and each page read
    would otherwise stay in the process's resident memory until the files are closed after the load (a whole
    checkpoint's worth). The pages stay in the page cache; a later read maps them again. Only ranges inside a
    mapping of that file are advised (never anonymous memory, which MADV_DONTNEED would zero)."""

    MADV_DONTNEED = 4

    def __init__(self) -> None:
        self.files: dict[int, str] = {}  # id(handle) -> the file's real path
        self._ranges: dict[str, list[tuple[int, int]]] = {}
        self._touched: list[tuple[torch.Tensor, str]] = []

    def touched(self, tensor: torch.Tensor, handle_id: int) -> torch.Tensor:
        self._touched.append((tensor, self.files[handle_id]))
        return tensor

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        try:
            yield
        finally:
            touched, self._touched = self._touched, []
            for tensor, path in touched:
                self._release(tensor, path)

    def _release(self, tensor: torch.Tensor, path: str) -> None:
        page = mmap.PAGESIZE
        start = tensor.data_ptr()
        end = start + tensor.nbytes  # as stored: contiguous
        first, last = -(-start // page) * page, end // page * page
        if last <= first or not any(low <= start and end <= high for low, high in self._mapped(path)):
            return
        with contextlib.suppress(OSError, AttributeError):
            _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), self.MADV_DONTNEED)

    def _mapped(self, path: str) -> list[tuple[int, int]]:
        """The address ranges this process maps `path` at (Linux /proc/self/maps; none elsewhere)."""
        if path not in self._ranges:
            ranges = []
            with contextlib.suppress(OSError):
                with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
                    for line in maps:
                        fields = line.split(maxsplit=5)
                        if len(fields) == 6 and fields[5].rstrip("\n") == path:
                            low, high = fields[0].split("-")
                            ranges.append((int(low, 16), int(high, 16)))
            if not ranges:
                return []  # not mapped yet (or not Linux): ask again next time
            self._ranges[path] = ranges
        return self._ranges[path]


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mlx_float_levels(q: torch.Tensor, scales: torch.Tensor, mode: str) -> Int8Levels:
    """MLX mxfp4 / nvfp4 codes as exact int8: each E2M1 element doubled is an integer (-12..12) and the
    group's scale (a power of two, E8M0; or E4M3 for nvfp4) halved."""
    codes = _E2M1_TWICE[q.long()]
    if mode == "mxfp4":  # E8M0: 2^(e - 127)
        scale = torch.exp2(scales.to(torch.int32).float() - 127)
    else:
        scale = scales.view(torch.float8_e4m3fn).float() if scales.dtype == torch.uint8 else scales.float()
    return Int8Levels(codes, scale / 2, None)


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 weights [N, K] times their scale: one number, one per output [N, 1], or one per block
    [ceil(N / bn), ceil(K / bk)] (DeepSeek-V3 / Qwen3-FP8 `weight_scale_inv`, compressed-tensors block)."""
    w = weight.float()
    n, k = w.shape
    if scale.dim() < 2 or scale.shape[1] == 1:  # per tensor or per output channel
        return w * (scale.reshape(()) if scale.numel() == 1 else scale.reshape(n, 1))
    bn, bk = -(-n // scale.shape[0]), -(-k // scale.shape[1])
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return w * full
