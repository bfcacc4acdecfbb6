"""RecurrentGemma's (Griffin's) recurrent block: a conv, then the Real-Gated Linear Recurrent Unit.

    y = gelu(linear_y(h));  x = conv_1d(linear_x(h))
    i_t = sigmoid(x W_i + b_i), r_t = sigmoid(x W_r + b_r)   (block-diagonal: one [w, w] matrix a head)
    log a_t = -8 r_t softplus(recurrent_param);  u_t = x_t i_t sqrt(1 - a_t^2)   (u_t = x_t i_t at position 0)
    s_t = a_t s_{t-1} + u_t;  out = linear_out(s * y)

States a sequence: the conv window [lru_width, K-1] and s [lru_width] in float32. A prompt chunk
runs the recurrence as a product of decays inside blocks of `SCAN_BLOCK` positions (s_t =
sum_j exp(log a_{j+1} + ... + log a_t) u_j, plus the carried state), one block after another;
a decode row one multiply-add. Parameter names are the checkpoint's (`linear_x`, `linear_y`,
`linear_out`, `conv_1d`, `rg_lru.*`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mlxcel.layers.decoder import activation
from mlxcel.layers.mamba2 import segsum
from mlxcel.layers.quant import linear
from mlxcel.layers.recurrent import StateSpec, causal_conv
from mlxcel.layers.recurrent_mixer import RecurrentMixer

SCAN_BLOCK = 16  # positions a block of the chunked recurrence ([S, C, 16, 16] decays a block)


@dataclass(frozen=True)
class RGLRURecipe:
    lru_width: int
    num_heads: int
    conv_width: int
    activation: str = "gelu_pytorch_tanh"

    rope = None  # the MixerRecipe protocol of layers/decoder.py
    has_kv = False  # a recurrent layer: no keys and values in the KV cache
    head_dim = 0

    def build(self, hidden_size: int, layer_idx: int, rope: object = None, norm: object = None) -> RecurrentBlock:
        return RecurrentBlock(hidden_size, self, layer_idx)


class RGLRU(nn.Module):
    """The RG-LRU's parameters (`rg_lru.*`) and gates."""

    def __init__(self, recipe: RGLRURecipe) -> None:
        super().__init__()
        heads, block = recipe.num_heads, recipe.lru_width // recipe.num_heads
        self.num_heads = heads
        self.recurrent_param = nn.Parameter(torch.zeros(recipe.lru_width))
        self.input_gate_weight = nn.Parameter(torch.zeros(heads, block, block))
        self.input_gate_bias = nn.Parameter(torch.zeros(heads, block))
        self.recurrent_gate_weight = nn.Parameter(torch.zeros(heads, block, block))
        self.recurrent_gate_bias = nn.Parameter(torch.zeros(heads, block))

    def gates(self, x: torch.Tensor, reset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., C], reset [...] (position 0) -> (log a [..., C] float32, u [..., C] in x's dtype)."""
        heads = x.view(*x.shape[:-1], self.num_heads, -1)
        gate_in = torch.sigmoid(torch.einsum("...hi,hij->...hj", heads, self.input_gate_weight)
                                + self.input_gate_bias).reshape(x.shape)
        gate_a = torch.sigmoid(torch.einsum("...hi,hij->...hj", heads, self.recurrent_gate_weight)
                               + self.recurrent_gate_bias).reshape(x.shape)
        log_a = -8.0 * gate_a * F.softplus(self.recurrent_param)
        scale = torch.sqrt(1 - torch.exp(2 * log_a))
        scale = torch.where(reset.unsqueeze(-1), torch.ones_like(scale), scale)
        return log_a.float(), x * gate_in * scale.to(x.dtype)


class RecurrentBlock(RecurrentMixer):
    def __init__(self, hidden_size: int, recipe: RGLRURecipe, layer_idx: int) -> None:
        super().__init__()
        width = recipe.lru_width
        self.layer_idx, self.width, self.act = layer_idx, width, activation(recipe.activation)
        self.state_spec = StateSpec((width, recipe.conv_width - 1), (width,))
        self.linear_y = nn.Linear(hidden_size, width)
        self.linear_x = nn.Linear(hidden_size, width)
        self.linear_out = nn.Linear(width, hidden_size)
        self.conv_1d = nn.Conv1d(width, width, recipe.conv_width, groups=width, padding=recipe.conv_width - 1)
        self.rg_lru = RGLRU(recipe)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: object) -> torch.Tensor:
        y = self.act(linear(self.linear_y, x, ctx))
        # The reset flag (position 0) rides along as one more column of the recurrence's input.
        u = torch.cat((linear(self.linear_x, x, ctx), (positions == 0).to(x.dtype).unsqueeze(-1)), dim=-1)
        return linear(self.linear_out, self.recur(u, ctx) * y, ctx)

    def scan(self, u: torch.Tensor, conv: torch.Tensor | None, recurrent: torch.Tensor | None,
             valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """u [S, L, width + 1] (x, reset flag) -> (s [S, L, width], conv, s after the last valid position)."""
        x, reset = u[..., :-1], u[..., -1] > 0
        x, conv = causal_conv(x, self.conv_1d.weight[:, 0, :], self.conv_1d.bias, conv, valid)
        log_a, inputs = self.rg_lru.gates(x, reset)
        if valid is not None:  # a padded position keeps the state: a = 1, no input
            log_a = log_a * valid.unsqueeze(-1)
            inputs = inputs * valid.unsqueeze(-1).to(inputs.dtype)
        state = recurrent.float() if recurrent is not None else x.new_zeros(x.shape[0], self.width, dtype=torch.float32)
        if x.shape[1] == 1:
            state = torch.exp(log_a[:, 0]) * state + inputs[:, 0].float()
            return state.unsqueeze(1).to(x.dtype), conv, state
        outputs = []
        for start in range(0, x.shape[1], SCAN_BLOCK):
            block, state = linear_scan(log_a[:, start:start + SCAN_BLOCK], inputs[:, start:start + SCAN_BLOCK], state)
            outputs.append(block)
        return torch.cat(outputs, dim=1).to(x.dtype), conv, state


def linear_scan(log_a: torch.Tensor, inputs: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """s_t = a_t s_{t-1} + u_t over a block at once: log_a, inputs [S, Q, C], state [S, C] ->
    (s [S, Q, C] float32, the last s)."""
    decay = torch.exp(segsum(log_a.transpose(1, 2)))  # [S, C, Q(t), Q(j)]: a_{j+1} ... a_t
    out = torch.einsum("sctj,sjc->stc", decay, inputs.float())
    out = out + torch.exp(log_a.cumsum(1)) * state.unsqueeze(1)
    return out, out[:, -1]
