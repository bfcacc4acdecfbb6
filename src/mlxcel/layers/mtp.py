"""A multi-token-prediction head built from the target's own decoder blocks (F10, issue 41).

Qwen3-Next and Qwen3.5 ship one MTP layer beside the main model (`mtp.*`: `pre_fc_norm_embedding`,
`pre_fc_norm_hidden`, `fc` over [embedding; hidden state], `layers.0` — a full-attention decoder layer
of the target's own kind, gated attention and its MLP or MoE — and a final `norm`; embedding and
output head are the target's). transformers 5.25 drops these weights; its generic `MtpLayer`
(modeling_layers.py) and vLLM's qwen3_next_mtp compute the same thing, with the embedding first.

`MtpHead` is that layer over rows laid out as engine/spec/mtp.py's drafter gives them: each row
fuses the target's final hidden state of the previous position with this position's token
embedding, and attends over the head's own keys and values of earlier rows (a plain contiguous
context the drafter owns, not the paged cache).
"""

from __future__ import annotations

import torch
from torch import nn

from mlxcel.layers.attention import PLAIN, ScoreRule, sdpa
from mlxcel.layers.decoder import DecoderArgs, Rope


class RowsContext:
    """The attention context of an MTP head's rows: causal among themselves, after `context`'s keys and
    values [c, kv_heads, head_dim]; keeps the rows' own keys and values (`keys`, `values`) for the caller."""

    def __init__(self, context: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.context = context
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def num_decode_rows(self, num_rows: int) -> int | None:
        return None  # a plain forward: each projection picks its kernel by size

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               scale: float, window: int | None = None, rule: ScoreRule = PLAIN) -> torch.Tensor:
        """q: [n, Hq, D], k/v: [n, Hkv, D] -> [n, Hq, D]."""
        if window is not None:
            raise ValueError("an MTP head's attention layer has no sliding window")
        self.keys, self.values = k, v
        keys, values = (k, v) if self.context is None else (torch.cat((self.context[0], k)),
                                                            torch.cat((self.context[1], v)))
        n, num_context = len(q), len(keys) - len(q)
        mask = torch.ones(n, len(keys), dtype=torch.bool, device=q.device)
        mask[:, num_context:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        out = sdpa(q.transpose(0, 1)[None], keys.transpose(0, 1)[None].to(q.dtype),
                   values.transpose(0, 1)[None].to(q.dtype), scale=scale, rule=rule, mask=mask)
        return out[0].transpose(0, 1)


class MtpHead(nn.Module):
    """One MTP layer: `fc([norm_e(embedding); norm_h(hidden)])`, a decoder layer, `norm`; parameter
    names equal the checkpoint's under `mtp.` (the decoder layer's under `layers.0.`)."""

    def __init__(self, args: DecoderArgs, layer_idx: int, rope: Rope | None) -> None:
        """`layer_idx`: a full-attention layer of the target whose recipe the MTP layer shares."""
        super().__init__()
        hidden, norm = args.hidden_size, args.norm_recipe()
        self.pre_fc_norm_embedding = norm.build(hidden)
        self.pre_fc_norm_hidden = norm.build(hidden)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([args.layer_recipe(layer_idx).build(hidden, layer_idx, rope, 0)])
        self.norm = norm.build(hidden)

    def forward(self, previous: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                context: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows [n, hidden] (the previous position's final hidden state, this position's token embedding)
        at `positions` [n] after `context`: their normed outputs, and their own keys and values."""
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(previous)), dim=-1))
        ctx = RowsContext(context)
        x = self.layers[0](x, positions, ctx)  # type: ignore[arg-type]
        assert ctx.keys is not None and ctx.values is not None
        return self.norm(x), ctx.keys, ctx.values


def build_mtp_head(target: nn.Module) -> MtpHead:
    """An MTP head for `target` (a decoder LM whose `args` say its layers), its weights still to load: its
    decoder layer is built as the target's first attention layer is, over the target's rotary table."""
    args: DecoderArgs = target.args
    layer_idx = mtp_layer_index(args)
    attention = getattr(target.model.layers[layer_idx], args.layer_recipe(layer_idx).attention_name)
    return MtpHead(args, layer_idx, attention.rope[0] if attention.rope else None)


def mtp_layer_index(args: DecoderArgs) -> int:
    """The target's first attention layer: the MTP layer is built, and its weights sanitized, as that one's."""
    for i in range(args.num_hidden_layers):
        if getattr(args.layer_recipe(i).attention, "has_kv", True):
            return i
    raise ValueError("the target has no attention layer for the MTP layer to share")
