"""The short causal depthwise convolution every recurrent mixer runs before its recurrence (Mamba-2's
conv over x, B, C; LFM2's gated short conv; RecurrentGemma's conv before the RG-LRU).

Its state is the last `K - 1` inputs of a sequence (K: the kernel width), channels first:
[C, K - 1] a sequence. A chunk of new inputs is convolved in one call with that state prepended, so a
prompt in pieces gives the same outputs as in one; a batch of single-token rows takes one
multiply-add over the window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_chunk(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunk: x [L, C], state [C, K-1], weight [C, K] -> (y [L, C], new state [C, K-1])."""
    width = weight.shape[-1]
    window = torch.cat((state.to(x.dtype), x.t()), dim=-1)  # [C, K-1+L]
    y = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1).to(x.dtype), None if bias is None else bias.to(x.dtype),
                 groups=weight.shape[0]).squeeze(0)  # [C, L]
    return y.t(), window[:, window.shape[-1] - (width - 1):]


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of single-token rows: x [B, C], state [B, C, K-1] -> (y [B, C], new state [B, C, K-1])."""
    window = torch.cat((state.to(x.dtype), x.unsqueeze(-1)), dim=-1)  # [B, C, K]
    y = (window * weight.to(x.dtype)).sum(-1)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y, window[..., 1:]
