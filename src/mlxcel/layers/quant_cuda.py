"""Quantized weights kept quantized on CUDA (issue 42): a rewrite of a finished model, as layers/quant.py is on the CPU.

- 4-bit integer codes with a low and a step per group (MLX affine 4-bit, GPTQ / AWQ 4-bit, compressed-tensors
  W4A16: `Int4Levels`, w = low + q * step) go through torch's int4 "tinygemm" kernel
  (`aten._weight_int4pack_mm`: bfloat16 activations, the weight dequantized inside the GEMM). Its layout is
  packed once at load (`_convert_weight_to_int4pack` over two levels a byte, high nibble first) with a
  [K / group, N, 2] table of (scale, zero) in bfloat16, where the kernel computes (q - 8) * scale + zero: so
  zero = low + 8 * step. The group is the checkpoint's own (32 to 256) where its steps repeat so.
- FP8 (e4m3) weights with one scale per tensor or per output channel go through `torch._scaled_mm` on Hopper:
  the activations rounded to e4m3 per row (a dynamic scale, amax / 448, as vLLM's W8A8 dynamic), the
  weight's scale per column, bfloat16 out. Block-scaled FP8 stays dequantized to bfloat16.

Both run under CUDA graphs (no host syncs, no shape-dependent allocation outside torch's). Linears the
checkpoint stores otherwise (8-bit integer codes, g_idx-ordered GPTQ, block FP8, float) keep the bfloat16
path. Sibling projections (q/k/v, gate/up) are fused into one quantized matmul where every part is stored
alike, as `fuse_projections` does for bfloat16.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mlxcel.layers.quant import INT4_GROUP, Int4Levels, _cat_biases, _Checkpoint, _fuse_groups, _join

TINYGEMM_GROUPS = (256, 128, 64, 32)
FP8_MAX = 448.0  # the largest e4m3 value


class Int4CudaLinear(nn.Module):
    """y = x @ W.T (+ b) with W as 4-bit levels in tinygemm's layout (see the module's text)."""

    def __init__(self, levels: Int4Levels, bias: torch.Tensor | None, device: torch.device | str) -> None:
        super().__init__()
        n, k = levels.q.shape
        self.out_features, self.in_features = n, k
        self.group = _widest_group(levels)
        q = levels.q.to(device=device, dtype=torch.uint8)
        packed = (q[:, ::2] << 4 | q[:, 1::2]).contiguous()
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack(packed, _inner_k_tiles(k)))
        every = self.group // INT4_GROUP
        step, low = levels.step[:, ::every].float(), levels.low[:, ::every].float()
        table = torch.stack((step, low + 8 * step), dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", table.to(device=device, dtype=torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().to(device=device, dtype=torch.bfloat16))

    @staticmethod
    def fits(levels: Int4Levels) -> bool:
        n, k = levels.q.shape
        return n % 8 == 0 and k % 64 == 0

    def forward(self, x: torch.Tensor, step: object = None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm(rows, self.qweight, self.group, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


@dataclass(frozen=True)
class Fp8Weight:
    """An e4m3 weight [N, K] and its scale per output channel [N] (float32): w = weight * scale."""

    weight: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def cat(parts: Sequence[Fp8Weight]) -> Fp8Weight:
        return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]))


class Fp8CudaLinear(nn.Module):
    """y = x @ W.T (+ b) through `torch._scaled_mm`: e4m3 activations with a scale per row, the e4m3 weight with
    its scale per output channel, bfloat16 out."""

    def __init__(self, weight: Fp8Weight, bias: torch.Tensor | None, device: torch.device | str) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.weight.shape
        self.register_buffer("weight", weight.weight.to(device=device, dtype=torch.float8_e4m3fn).contiguous())
        self.register_buffer("weight_scale", weight.scale.to(device=device, dtype=torch.float32).view(1, -1).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(device=device, dtype=torch.bfloat16))

    @staticmethod
    def fits(weight: Fp8Weight) -> bool:
        n, k = weight.weight.shape
        return n % 16 == 0 and k % 16 == 0

    def forward(self, x: torch.Tensor, step: object = None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        scale = (rows.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)  # [M, 1]
        a = (rows.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(a, self.weight.t(), scale_a=scale, scale_b=self.weight_scale, out_dtype=torch.bfloat16)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def _widest_group(levels: Int4Levels) -> int:
    """The widest tinygemm group (256 .. 32) over which every step and low of `levels` (kept per 32) repeats."""
    k = levels.q.shape[1]
    for group in TINYGEMM_GROUPS:
        every = group // INT4_GROUP
        if k % group:
            continue
        if every == 1:
            return group
        step, low = (t.view(t.shape[0], -1, every) for t in (levels.step, levels.low))
        if bool((step == step[..., :1]).all()) and bool((low == low[..., :1]).all()):
            return group
    return INT4_GROUP


def _inner_k_tiles(k: int) -> int:
    return 8 if k % 128 == 0 else 4 if k % 64 == 0 else 2


@dataclass(frozen=True, slots=True)
class CudaQuantSummary:
    num_int4: int
    num_fp8: int
    num_bf16: int

    def __str__(self) -> str:
        return (f"{self.num_int4} 4-bit (tinygemm) and {self.num_fp8} FP8 (scaled_mm) matmuls kept as the checkpoint "
                f"stores them, {self.num_bf16} bfloat16 (stored otherwise)")


def keep_quantized(model: nn.Module, device: torch.device | str) -> CudaQuantSummary:
    """Replace, in place, each linear the checkpoint stores as 4-bit levels or per-channel FP8 (`model.packed_weights`,
    a quantized folder) with its CUDA module; q/k/v and gate/up fused where every part is stored alike. The others
    stay (bfloat16, read from the checkpoint dequantized)."""
    checkpoint = _Checkpoint(model)
    fp8_reader = getattr(checkpoint.packed, "fp8_weight", None)

    def stored(prefix: str) -> Int4Levels | Fp8Weight | None:
        levels = checkpoint.levels(prefix)
        if levels is not None:
            return levels if Int4CudaLinear.fits(levels) else None
        fp8 = fp8_reader(f"{prefix}.weight") if fp8_reader is not None else None
        return fp8 if fp8 is not None and Fp8CudaLinear.fits(fp8) else None

    def build(prefixes: list[str], linears: list[nn.Linear]) -> nn.Module | None:
        weights = [stored(p) for p in prefixes]
        bias = _cat_biases([checkpoint.param(p, lin, "bias") for p, lin in zip(prefixes, linears)])
        if all(isinstance(w, Int4Levels) for w in weights):
            module: nn.Module = Int4CudaLinear(Int4Levels.cat(weights), bias, device)  # type: ignore[arg-type]
        elif all(isinstance(w, Fp8Weight) for w in weights):
            module = Fp8CudaLinear(Fp8Weight.cat(weights), bias, device)  # type: ignore[arg-type]
        else:
            return None
        for prefix in prefixes:
            checkpoint.replaced(prefix)
        return module

    for prefix, parent in list(model.named_modules()):
        _fuse_groups(parent, lambda linears, names: build([_join(prefix, n) for n in names], linears))
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                module = build([_join(prefix, name)], [child])
                if module is not None:
                    setattr(parent, name, module)
    kinds = [type(m) for m in model.modules()]
    return CudaQuantSummary(kinds.count(Int4CudaLinear), kinds.count(Fp8CudaLinear), kinds.count(nn.Linear))
