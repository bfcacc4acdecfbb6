"""LFM2's gated short convolution: B, C, x = in_proj(h); y = C * conv(B * x); out = out_proj(y).

Its only state is the conv window, [hidden, K-1] a sequence (K: `conv_L_cache`); a prompt chunk
is one depthwise conv over the chunk with the window prepended, a decode row one multiply-add over
the window (layers/recurrent.py's `causal_conv` does both). Parameter names are the checkpoint's
(`in_proj`, `conv`, `out_proj`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mlxcel.layers.quant import linear
from mlxcel.layers.recurrent import StateSpec, causal_conv
from mlxcel.layers.recurrent_mixer import RecurrentMixer


@dataclass(frozen=True)
class ShortConvRecipe:
    kernel: int
    bias: bool = False

    rope = None  # the MixerRecipe protocol of layers/decoder.py
    has_kv = False  # a recurrent layer: no keys and values in the KV cache
    head_dim = 0

    def build(self, hidden_size: int, layer_idx: int, rope: object = None, norm: object = None) -> ShortConv:
        return ShortConv(hidden_size, self, layer_idx)


class ShortConv(RecurrentMixer):
    def __init__(self, hidden_size: int, recipe: ShortConvRecipe, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx, self.hidden_size = layer_idx, hidden_size
        self.state_spec = StateSpec(conv_shape=(hidden_size, recipe.kernel - 1))
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=recipe.bias)
        self.conv = nn.Conv1d(hidden_size, hidden_size, recipe.kernel, groups=hidden_size, bias=recipe.bias,
                              padding=recipe.kernel - 1)
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=recipe.bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: object) -> torch.Tensor:
        b, c, h = linear(self.in_proj, x, ctx).chunk(3, dim=-1)
        return linear(self.out_proj, c * self.recur(b * h, ctx), ctx)

    def scan(self, u: torch.Tensor, conv: torch.Tensor | None, recurrent: torch.Tensor | None,
             valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        y, conv = causal_conv(u, self.conv.weight[:, 0, :], self.conv.bias, conv, valid)
        return y, conv, None
