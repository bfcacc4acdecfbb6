"""Normalisation layers with the parameter name `weight`, as in HF checkpoints."""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    """y = x / rms(x) * weight; `offset=1.0` gives Gemma's x * (1 + weight) form."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The reference implementations' float32 formula, op for op (so logits match them bit for
        # bit). NOTE: F.rms_norm takes OpenMP's parallel path even for one 576-wide row, which
        # cost ~2x these four small ops on a decode step.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.effective_weight()).to(x.dtype)

    def effective_weight(self) -> torch.Tensor:
        if self.offset == 0.0 and self.weight.dtype == torch.float32:
            return self.weight
        return self.weight.float() + self.offset


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, with no weight (Gemma 4's value norm), in float32 as RMSNorm."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class LayerNorm(torch.nn.Module):
    """Mean-centred norm with `weight` (and `bias` where the checkpoint has one: StarCoder 2;
    Cohere's has none), in float32 as the references compute it."""

    def __init__(self, dim: int, eps: float = 1e-5, *, bias: bool = True) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.bias = torch.nn.Parameter(torch.zeros(dim)) if bias else None
        self.eps = eps
        self.offset = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.float() if self.bias is not None else None
        return torch.nn.functional.layer_norm(x.float(), x.shape[-1:], self.weight.float(), bias, self.eps).to(x.dtype)
