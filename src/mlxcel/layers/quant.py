"""Weight-only int8 linears for CPU decode: a rewrite of a finished model (DESIGN rule 3).

At one token a step a linear is bound by the bytes of its weights, so int8 weights with
bfloat16 activations (`aten._weight_int8pack_mm`) run about 2.4x faster than bfloat16;
from about 8 tokens a step oneDNN's bfloat16 matmul wins (PERF.md). `Int8Linear` keeps
both forms and picks by the number of tokens in the step.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

INT8_MAX_TOKENS = 8  # below this many rows a step uses the int8 kernel


class Int8Linear(nn.Module):
    """y = x @ W.T (+ b) with W kept as per-output-channel symmetric int8 and as bfloat16."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.register_buffer("weight", weight.detach().to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16))
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16).reshape(-1, self.in_features)
        if xb.shape[0] < INT8_MAX_TOKENS:
            y = torch.ops.aten._weight_int8pack_mm(xb, self.qweight, self.scale)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = F.linear(xb, self.weight, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


class Int8Head(nn.Module):
    """Output head: int8/bfloat16 logits, with the top candidates recomputed in float32.

    bfloat16 logits near 25 are only resolved to 0.125, enough to flip a greedy choice
    (SmolLM2's "The" vs "L" differ by 0.08). The best `num_refined` rows of each step are
    therefore recomputed with float32 accumulation, so ranking at the top is exact.
    """

    def __init__(self, weight: torch.Tensor, num_refined: int = 16) -> None:
        super().__init__()
        self.linear = Int8Linear(weight, None)
        self.num_refined = min(num_refined, weight.shape[0])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear(hidden).float()  # [N, vocab]
        top = logits.topk(self.num_refined, dim=-1).indices  # [N, k]
        rows = self.linear.weight[top].float()  # [N, k, hidden]
        exact = torch.einsum("nkd,nd->nk", rows, hidden.float())
        return logits.scatter_(1, top, exact)


def can_quantize_int8() -> bool:
    try:
        x = torch.zeros(1, 32, dtype=torch.bfloat16)
        torch.ops.aten._weight_int8pack_mm(x, torch.zeros(32, 32, dtype=torch.int8), torch.ones(32, dtype=torch.bfloat16))
        return True
    except (RuntimeError, AttributeError):
        return False


def quantize_int8(model: nn.Module) -> int:
    """Replace every nn.Linear (and a tied output head) in place; returns how many were replaced."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child.weight, child.bias))
                count += 1
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if isinstance(head, Int8Linear):  # untied: replaced above as a plain linear
        model.lm_head = Int8Head(head.weight)
    elif head is None and isinstance(embed, nn.Embedding):
        # Tied output head: the largest matmul of a decode step, quantized like the rest.
        model.lm_head = Int8Head(embed.weight)
        count += 1
    return count
