"""Weight-only int8 linears for CPU decode: a rewrite of a finished model (DESIGN rule 3).

At one token a step a linear is bound by the bytes of its weights, so int8 weights with
bfloat16 activations (`aten._weight_int8pack_mm`) run about 2.4x faster than bfloat16;
from about 8 tokens a step oneDNN's bfloat16 matmul wins (PERF.md). `Int8Linear` keeps
both forms. Inside an engine step it picks per row, not per step: the rows of single-token
sequences (decode) go through int8, the rows of prefill chunks through bfloat16. Both
kernels give each row the same bits whatever else is in the batch, so a request's greedy
output does not depend on its batch neighbours.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from mlxcel.layers.attention import current_step

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
        num_int8 = _num_int8_rows(xb.shape[0])
        if num_int8 == xb.shape[0]:
            y = self.int8_rows(xb)
        elif num_int8 == 0:
            y = F.linear(xb, self.weight, self.bias)
        else:
            y = torch.cat((self.int8_rows(xb[:num_int8]), F.linear(xb[num_int8:], self.weight, self.bias)))
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def int8_rows(self, xb: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(xb, self.qweight, self.scale)
        return y if self.bias is None else y + self.bias


def _num_int8_rows(num_rows: int) -> int:
    """How many leading rows take the int8 kernel: an engine step's single-token rows, else by size."""
    step = current_step()
    if step is not None and step.num_tokens == num_rows:
        return step.num_leading_single_rows
    return num_rows if num_rows < INT8_MAX_TOKENS else 0


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
        # Always the int8 kernel: one row per sampled sequence, bits independent of the batch.
        logits = self.linear.int8_rows(hidden.to(torch.bfloat16)).float()  # [N, vocab]
        top = logits.topk(self.num_refined, dim=-1).indices  # [N, k]
        rows = self.linear.weight[top].float()  # [N, k, hidden]
        exact = torch.einsum("nkd,nd->nk", rows, hidden.float())
        return logits.scatter_(1, top, exact)


# Sibling linears that read the same input in every family here; each group becomes one matmul.
FUSABLE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedInt8Linear(nn.Module):
    """Several linears over one input computed as a single int8/bfloat16 matmul.

    The model still calls each projection by its own name: `FusedOutput` modules stand in
    for them and return their slice of the fused result, computed once per input tensor.
    """

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        weight = torch.cat([lin.weight for lin in linears])
        has_bias = all(lin.bias is not None for lin in linears)
        bias = torch.cat([lin.bias for lin in linears]) if has_bias else None
        self.linear = Int8Linear(weight, bias)
        self.sizes = [lin.out_features for lin in linears]
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if x is not self._input:
            self._outputs = self.linear(x).split(self.sizes, dim=-1)
            self._input = x
        return self._outputs[index]


class FusedOutput(nn.Module):
    def __init__(self, fused: FusedInt8Linear, index: int) -> None:
        super().__init__()
        self._fused = [fused]  # a list: the group is registered once, on the parent
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused[0].output(x, self.index)


def _fuse_groups(parent: nn.Module) -> int:
    count = 0
    for names in FUSABLE_GROUPS:
        linears = [getattr(parent, n, None) for n in names]
        if not all(isinstance(lin, nn.Linear) for lin in linears):
            continue
        fused = FusedInt8Linear(linears)  # type: ignore[arg-type]
        parent.add_module("fused_" + "_".join(n.split("_")[0] for n in names), fused)
        for index, name in enumerate(names):
            setattr(parent, name, FusedOutput(fused, index))
        count += len(names)
    return count


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
        count += _fuse_groups(parent)
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
