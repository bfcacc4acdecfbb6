"""Normalisation layers with the parameter name `weight`, as in HF checkpoints."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    """y = x / rms(x) * weight; `offset=1.0` gives Gemma's x * (1 + weight) form."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Compute in float32 as the reference implementations do; cast back after.
        out = F.rms_norm(x.float(), (x.shape[-1],), self.effective_weight(), self.eps)
        return out.to(x.dtype)

    def effective_weight(self) -> torch.Tensor:
        if self.offset == 0.0 and self.weight.dtype == torch.float32:
            return self.weight
        return self.weight.float() + self.offset
