"""Writers of quantized linears as the tools lay them out (issue 42), for tests that need a quantized folder where
the tool itself does not run: AutoGPTQ's and AutoAWQ's packings (test_quantized_checkpoints.py) and MLX's affine
packing (tests/engine/test_cuda_quantized.py, on the GPU, where mlx does not install). Each writer also returns
the float weight its tensors encode, which a transformers model takes as the reference."""

from __future__ import annotations

import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's GEMM packing: nibble i of a word holds column AWQ_ORDER[i]


def pack_lsb(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [R, C] -> int32 words [R, C * bits / 32] along C, each word's first field in its lowest bits."""
    per = 32 // bits
    words = ((values.to(torch.int64) & ((1 << bits) - 1)).view(values.shape[0], -1, per)
             << (torch.arange(per) * bits)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def affine_codes(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [N, K] in 0..2^bits-1, float16 scales and integer zeros [N, K / group]: w ~ (q - zero) * scale."""
    n, k = w.shape
    groups = w.view(n, k // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / ((1 << bits) - 1)).clamp(min=1e-6).half().float()
    zero = torch.round(-low / scale).clamp(0, (1 << bits) - 1)
    q = torch.round(groups / scale[..., None] + zero[..., None]).clamp(0, (1 << bits) - 1)
    return q.view(n, k).to(torch.int64), scale, zero.to(torch.int64)


def gptq_linear(w: torch.Tensor, bits: int, group: int, desc_act: bool) -> tuple[dict, torch.Tensor]:
    """AutoGPTQ's tensors of one linear (zeros stored less one) and the float weight they encode. With
    `desc_act`, groups are formed over a permutation of the inputs and each input's group is its g_idx."""
    n, k = w.shape
    order = torch.randperm(k, generator=torch.Generator().manual_seed(k + n)) if desc_act else torch.arange(k)
    q, scale, zero = affine_codes(w[:, order], bits, group)
    inverse = torch.argsort(order)
    q, g_idx = q[:, inverse], (torch.arange(k) // group)[inverse]
    tensors = {"qweight": pack_lsb(q, bits).t().contiguous(), "qzeros": pack_lsb(zero.t().contiguous() - 1, bits),
               "scales": scale.t().contiguous().half(), "g_idx": g_idx.to(torch.int32)}
    return tensors, (q - zero[:, g_idx]) * scale[:, g_idx]


def awq_linear(w: torch.Tensor, group: int) -> tuple[dict, torch.Tensor]:
    n, k = w.shape
    q, scale, zero = affine_codes(w, 4, group)
    columns = lambda t: t.view(t.shape[0], -1, 8)[:, :, AWQ_ORDER].reshape(t.shape[0], -1)  # noqa: E731
    tensors = {"qweight": pack_lsb(columns(q.t().contiguous()), 4), "qzeros": pack_lsb(columns(zero.t().contiguous()), 4),
               "scales": scale.t().contiguous().half()}
    return tensors, (q - zero.repeat_interleave(group, 1)) * scale.repeat_interleave(group, 1)


def mlx_affine_linear(w: torch.Tensor, bits: int, group: int) -> tuple[dict, torch.Tensor]:
    """mlx's `quantize` layout of one linear: `weight` as 32-bit words of `bits`-bit codes along K (first code in
    the lowest bits), float16 `scales` and `biases` [N, K / group], w = scales * q + biases."""
    q, scale, zero = affine_codes(w, bits, group)
    bias = (-zero * scale).half()
    tensors = {"weight": pack_lsb(q, bits), "scales": scale.half(), "biases": bias}
    full = lambda t: t.float().repeat_interleave(group, 1)  # noqa: E731
    return tensors, full(scale.half()) * q + full(bias)


def fp8_channel_linear(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """compressed-tensors' FP8 (float-quantized, per output channel): e4m3 `weight` and `weight_scale` [N, 1]."""
    scale = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448
    codes = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale": scale}, codes.float() * scale
