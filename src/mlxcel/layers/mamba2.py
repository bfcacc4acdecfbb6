"""Mamba-2 (SSD) mixer with its causal conv and gated RMSNorm: Nemotron-H, Granite 4, Falcon-H1.

    zxbcdt = in_proj(x)
    z | xBC | dt;  xBC = silu(conv(xBC)) -> x | B | C
    state_t = state_{t-1} * exp(dt_t * A) + dt_t * x_t (outer) B_t;  y_t = state_t . C_t + D * x_t
    out = out_proj(norm(y, gate z))            (per-group RMSNorm of y * silu(z), or Falcon's variants)

States a sequence: the conv window [conv_dim, K-1] and the SSM state [heads, head_dim, state_size]
in float32. A prompt chunk runs the chunked SSD scan (the quadratic form inside chunks of
`chunk_size`, the state carried between chunks); decode rows the one-step update.
Parameter names are the checkpoint's (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`, `out_proj`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mlxcel.layers.quant import linear
from mlxcel.layers.recurrent import StateSpec, causal_conv
from mlxcel.layers.recurrent_mixer import RecurrentMixer


@dataclass(frozen=True)
class Mamba2Recipe:
    num_heads: int
    head_dim: int
    state_size: int
    num_groups: int
    conv_kernel: int
    chunk_size: int = 256
    eps: float = 1e-5
    proj_bias: bool = False
    conv_bias: bool = True
    out_bias: bool | None = None  # None: as proj_bias
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    has_norm: bool = True  # Falcon-H1's mamba_rms_norm (without it: y * silu(z))
    norm_before_gate: bool = False

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner_size + 2 * self.num_groups * self.state_size

    def build(self, hidden_size: int, layer_idx: int, rope: object = None, norm: object = None) -> Mamba2Mixer:
        return Mamba2Mixer(hidden_size, self, layer_idx)

    # The MixerRecipe protocol of layers/decoder.py: no rope.
    rope = None
    has_kv = False  # a recurrent layer: no keys and values in the KV cache


class GatedRMSNorm(nn.Module):
    """RMSNorm per group of `group_size` channels with a SiLU gate, applied before the norm (Mamba-2's
    default) or after it (`norm_before_gate`)."""

    def __init__(self, dim: int, group_size: int, eps: float, norm_before_gate: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps, self.norm_before_gate = group_size, eps, norm_before_gate

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if not self.norm_before_gate:
            h = h * F.silu(gate.float())
        groups = h.view(*h.shape[:-1], -1, self.group_size)
        h = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)).view(h.shape)
        if self.norm_before_gate:
            return (self.weight.float() * h * F.silu(gate.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


class Mamba2Mixer(RecurrentMixer):
    def __init__(self, hidden_size: int, recipe: Mamba2Recipe, layer_idx: int) -> None:
        super().__init__()
        r = self.recipe = recipe
        self.layer_idx = layer_idx
        self.state_spec = StateSpec((r.conv_dim, r.conv_kernel - 1), (r.num_heads, r.head_dim, r.state_size))
        self.in_proj = nn.Linear(hidden_size, r.inner_size + r.conv_dim + r.num_heads, bias=r.proj_bias)
        self.conv1d = nn.Conv1d(r.conv_dim, r.conv_dim, r.conv_kernel, groups=r.conv_dim, bias=r.conv_bias,
                                padding=r.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(r.num_heads))
        self.A_log = nn.Parameter(torch.zeros(r.num_heads))
        self.D = nn.Parameter(torch.ones(r.num_heads))
        if r.has_norm:
            self.norm = GatedRMSNorm(r.inner_size, r.inner_size // r.num_groups, r.eps, r.norm_before_gate)
        out_bias = r.proj_bias if r.out_bias is None else r.out_bias
        self.out_proj = nn.Linear(r.inner_size, hidden_size, bias=out_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: object) -> torch.Tensor:
        r = self.recipe
        projected = linear(self.in_proj, x, ctx)
        gate, u = projected.split([r.inner_size, r.conv_dim + r.num_heads], dim=-1)
        y = self.recur(u, ctx)
        if r.has_norm:
            y = self.norm(y, gate)
        else:
            y = y * F.silu(gate)
        return linear(self.out_proj, y, ctx)

    def _dt(self, dt: torch.Tensor) -> torch.Tensor:
        lo, hi = self.recipe.dt_limit
        dt = F.softplus(dt.float() + self.dt_bias.float())
        return dt if (lo, hi) == (0.0, float("inf")) else dt.clamp(lo, hi)

    def scan(self, u: torch.Tensor, conv: torch.Tensor | None, recurrent: torch.Tensor | None,
             valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """u [S, L, conv_dim + heads] (xBC, dt) -> y [S, L, inner] before the gated norm."""
        r = self.recipe
        num_seqs, length = u.shape[:2]
        xbc, dt = u.split([r.conv_dim, r.num_heads], dim=-1)
        xbc, conv = causal_conv(xbc, self.conv1d.weight[:, 0, :], self.conv1d.bias, conv, valid)
        groups = r.num_groups * r.state_size
        xs, b, c = F.silu(xbc).split([r.inner_size, groups, groups], dim=-1)
        dt = self._dt(dt)
        if valid is not None:  # a padded position neither decays nor feeds the state (dt 0)
            dt = dt * valid.unsqueeze(-1)
        if recurrent is None:
            recurrent = u.new_zeros(num_seqs, *self.state_spec.recurrent_shape, dtype=torch.float32)
        xs = xs.reshape(num_seqs, length, r.num_heads, r.head_dim)
        b = b.reshape(num_seqs, length, r.num_groups, r.state_size)
        c = c.reshape(num_seqs, length, r.num_groups, r.state_size)
        a = -torch.exp(self.A_log.float())
        if length == 1:
            y, recurrent = ssd_step(xs[:, 0], dt[:, 0], a, b[:, 0], c[:, 0], self.D, recurrent)
            y = y.unsqueeze(1)
        else:
            y, recurrent = ssd_chunked(xs, dt, a, b, c, self.D, recurrent, r.chunk_size)
        return y.reshape(num_seqs, length, r.inner_size).to(u.dtype), conv, recurrent


def segsum(x: torch.Tensor) -> torch.Tensor:
    """x [..., T] -> [..., T, T]: out[..., i, j] = x[j+1] + ... + x[i] for j <= i, -inf above the
    diagonal; summed from masked copies, not as a difference of cumulative sums (which loses the
    small sums of a long sequence's large totals)."""
    t = x.shape[-1]
    lower = torch.ones(t, t, dtype=torch.bool, device=x.device).tril(-1)
    sums = x[..., None, :].expand(*x.shape, t).transpose(-1, -2).masked_fill(~lower, 0).cumsum(-2)
    return sums.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=x.device).tril(), float("-inf"))


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                d: torch.Tensor, state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan of a batch of sequences in chunks, in float32.

    x [S, L, H, P], dt [S, L, H] (after bias and softplus; 0 at padding), a [H] (negative),
    b, c [S, L, G, N], d [H], state [S, H, P, N] before the chunk -> (y [S, L, H, P], state after it)."""
    num_seqs, length, num_heads, _ = x.shape
    heads_per_group = num_heads // b.shape[2]
    b = b.float().repeat_interleave(heads_per_group, dim=2)  # [S, L, H, N]
    c = c.float().repeat_interleave(heads_per_group, dim=2)
    xf = x.float()
    pad = (-length) % chunk_size
    xdt = F.pad(xf * dt[..., None], (0, 0, 0, 0, 0, pad))
    adt = F.pad(a * dt, (0, 0, 0, pad))  # [S, L', H]; padded steps neither decay nor add
    b, c = F.pad(b, (0, 0, 0, 0, 0, pad)), F.pad(c, (0, 0, 0, 0, 0, pad))
    nc = (length + pad) // chunk_size
    xdt, b, c = (t.view(num_seqs, nc, chunk_size, *t.shape[2:]) for t in (xdt, b, c))
    adt = adt.view(num_seqs, nc, chunk_size, num_heads).permute(0, 1, 3, 2)  # [S, C, H, Q]
    a_cum = adt.cumsum(-1)
    # Inside each chunk: the quadratic (attention-like) form.
    decay = torch.exp(segsum(adt))  # [S, C, H, Q(l), Q(s)]
    scores = torch.einsum("zclhn,zcshn->zchls", c, b) * decay
    y = torch.einsum("zchls,zcshp->zclhp", scores, xdt)
    # Each chunk's own contribution to the state at its end.
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [S, C, H, Q]
    chunk_states = torch.einsum("zclhn,zchl,zclhp->zchpn", b, to_end, xdt)
    # Between chunks: the state entering each chunk, from the initial state and earlier chunks.
    states = torch.cat((state.float()[:, None], chunk_states), dim=1)  # [S, C+1, H, P, N]
    carry = torch.exp(segsum(F.pad(a_cum[..., -1], (0, 0, 1, 0)).transpose(1, 2)))  # [S, H, C+1, C+1]
    entering = torch.einsum("zhcj,zjhpn->zchpn", carry, states)  # [S, C+1, H, P, N]
    y = y + torch.einsum("zclhn,zchpn->zclhp", c, entering[:, :-1]) * torch.exp(a_cum).permute(0, 1, 3, 2)[..., None]
    y = y.reshape(num_seqs, nc * chunk_size, num_heads, -1)[:, :length] + xf * d.float()[:, None]
    return y, entering[:, -1]


def ssd_step(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             d: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token a row: x [B, H, P], dt [B, H], b, c [B, G, N], state [B, H, P, N] -> (y [B, H, P], state)."""
    heads_per_group = x.shape[1] // b.shape[1]
    b = b.float().repeat_interleave(heads_per_group, dim=1)  # [B, H, N]
    c = c.float().repeat_interleave(heads_per_group, dim=1)
    xf = x.float()
    state = state.float() * torch.exp(dt * a)[..., None, None] + (xf * dt[..., None])[..., None] * b[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", state, c) + xf * d.float()[:, None]
    return y, state
