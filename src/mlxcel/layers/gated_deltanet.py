"""Gated DeltaNet (Qwen3-Next, Qwen3.5 / Qwen3.6): a linear-attention mixer with a per-sequence state.

Per layer: projections to q, k, v (through a causal depthwise conv and SiLU), a gate z, a write
strength beta = sigmoid(b) and a decay g = -exp(A_log) * softplus(a + dt_bias); per value head a
state S [Dk, Dv], each token decays it by exp(g), writes the delta beta * (v - S^T k) along k, and
reads S^T q; the output is RMS-normed, gated by SiLU(z) and projected back. Its states (conv and S)
live behind layers/recurrent.py.

Two forms, one result: the chunked prefill form (a prompt chunk of every sequence at once, in blocks
of CHUNK positions solved as a triangular system, a scan only over blocks) and the one-token decode
form (every sequence one row). Parameter names are Qwen3.5's (`in_proj_qkv`, `in_proj_z`,
`in_proj_b`, `in_proj_a`); Qwen3-Next's fused `in_proj_qkvz` / `in_proj_ba` are split into them at
load (`split_qwen3_next_projections`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mlxcel.layers.quant import linear
from mlxcel.layers.recurrent import RecurrentStates, StateSpec, causal_conv, states_of

CHUNK = 64  # positions solved together in the prefill form (the reference kernels' chunk)


@dataclass(frozen=True)
class GatedDeltaNetRecipe:
    """A Gated DeltaNet layer's shape; a `MixerRecipe` (no rope) for layers/decoder.py."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    eps: float = 1e-6
    rope: None = None
    head_dim: int = 0
    has_kv: bool = False  # a recurrent layer: its state lives in the state pool, not the KV cache
    # The value heads' order: "grouped" (HF: value head h reads key head h // (Hv / Hk)) or "tiled" (llama.cpp's
    # Qwen3.5 GGUFs, whose converter reorders them for ggml's broadcast: value head h reads key head h % Hk)
    v_head_order: str = "grouped"

    def build(self, hidden_size: int, layer_idx: int, rope: object, norm: object) -> nn.Module:
        return GatedDeltaNet(hidden_size, self, layer_idx)


class GatedRMSNorm(nn.Module):
    """RMSNorm of x times SiLU(gate), in float32 as the references compute it (`weight` plain, not 1 + w)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * x32.to(x.dtype)) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, recipe: GatedDeltaNetRecipe, layer_idx: int) -> None:
        super().__init__()
        r = self.recipe = recipe
        self.layer_idx = layer_idx
        self.key_dim, self.value_dim = r.num_k_heads * r.head_k_dim, r.num_v_heads * r.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, r.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, r.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, r.conv_kernel, groups=self.conv_dim, bias=False,
                                padding=r.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(r.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(r.num_v_heads))
        self.norm = GatedRMSNorm(r.head_v_dim, r.eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        if r.v_head_order not in ("grouped", "tiled"):
            raise ValueError(f"v_head_order must be 'grouped' or 'tiled', not {r.v_head_order!r}")
        self._tiled = r.v_head_order == "tiled"
        self.state_spec = StateSpec((self.conv_dim, r.conv_kernel - 1),
                                    (r.num_v_heads, r.head_k_dim, r.head_v_dim))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: object) -> torch.Tensor:
        """x [T, hidden] (the step's rows) -> [T, hidden]; states read and written through `ctx.states`."""
        states = states_of(ctx, x)
        conv0, rec0 = states.read(self.layer_idx)
        mixed = linear(self.in_proj_qkv, x, ctx)  # [T, conv_dim]
        z = linear(self.in_proj_z, x, ctx)
        beta = torch.sigmoid(linear(self.in_proj_b, x, ctx))  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(linear(self.in_proj_a, x, ctx).float() + self.dt_bias)
        if states.token_slots is not None:
            core = self._per_token(states, mixed, beta, g, conv0, rec0)
        else:
            core = self._sequences(states, mixed, beta, g, conv0, rec0)
        r = self.recipe
        out = self.norm(core.reshape(-1, r.head_v_dim), z.reshape(-1, r.head_v_dim))
        return linear(self.out_proj, out.reshape(x.shape[0], self.value_dim), ctx)

    def _conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight.squeeze(1)  # [C, K]

    def _split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., conv_dim] after the conv -> q, k [..., Hk, Dk] and v [..., Hv, Dv]."""
        r = self.recipe
        q, k, v = mixed.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        return (q.unflatten(-1, (r.num_k_heads, r.head_k_dim)), k.unflatten(-1, (r.num_k_heads, r.head_k_dim)),
                v.unflatten(-1, (r.num_v_heads, r.head_v_dim)))

    def _sequences(self, states: RecurrentStates, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                   conv0: torch.Tensor | None, rec0: torch.Tensor | None) -> torch.Tensor:
        """Every sequence's rows at once: the decode form when each has one row, else the chunked form."""
        valid = None if states.is_decode else states.valid
        batch = (lambda t: t.unsqueeze(1)) if states.is_decode else states.to_batch
        conv_out, conv1 = causal_conv(batch(mixed), self._conv_weight(), None, conv0, valid)
        q, k, v = self._split(F.silu(conv_out))  # [S, L, H, D]
        beta_b, g_b = batch(beta), batch(g)
        if valid is not None:  # padded positions neither decay nor write the state
            beta_b, g_b = beta_b * valid.unsqueeze(-1), g_b * valid.unsqueeze(-1)
        if states.is_decode:
            out, rec1 = recurrent_gated_delta_rule(q, k, v, g_b, beta_b, rec0, self._tiled)
        else:
            out, rec1 = chunk_gated_delta_rule(q, k, v, g_b, beta_b, rec0, self._tiled)
        states.write(self.layer_idx, conv1, rec1)
        return out.squeeze(1) if states.is_decode else states.from_batch(out)  # [T, Hv, Dv]

    def _per_token(self, states: RecurrentStates, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                   conv0: torch.Tensor | None, rec0: torch.Tensor | None) -> torch.Tensor:
        """Verify rows (a few a sequence): the decode form row after row, keeping every row's state."""
        batch, valid = states.to_batch, states.valid
        mixed_b, beta_b, g_b = batch(mixed), batch(beta), batch(g)
        conv, rec = conv0, rec0
        outs, convs, recs = [], [], []
        for i in range(states.max_len):
            live = valid[:, i:i + 1]  # [S, 1]
            conv_out, conv_next = causal_conv(mixed_b[:, i:i + 1], self._conv_weight(), None, conv)
            q, k, v = self._split(F.silu(conv_out))
            out, rec_next = recurrent_gated_delta_rule(q, k, v, g_b[:, i:i + 1] * live.unsqueeze(-1),
                                                       beta_b[:, i:i + 1] * live.unsqueeze(-1), rec, self._tiled)
            conv = torch.where(live.unsqueeze(-1), conv_next, conv) if conv is not None else conv_next
            rec = rec_next
            outs.append(out)
            convs.append(conv)
            recs.append(rec)
        states.write(self.layer_idx, conv, rec)
        states.write_tokens(self.layer_idx, states.from_batch(torch.stack(convs, 1)),
                            states.from_batch(torch.stack(recs, 1)))
        return states.from_batch(torch.cat(outs, 1))


# ---- the delta rule ----

def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, tiled: bool = False) -> tuple[torch.Tensor, ...]:
    """[S, L, H*, D] inputs -> float32 [S, Hv, L, D] with q, k repeated to the value heads (each key head
    `groups` times in a row, or `tiled`: the key heads `groups` times over), L2-normed, q scaled by
    Dk ** -0.5; g, beta [S, Hv, L]."""
    groups = v.shape[2] // k.shape[2]
    if groups > 1 and tiled:
        q, k = q.repeat(1, 1, groups, 1), k.repeat(1, 1, groups, 1)
    elif groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    q, k, v, g, beta = (t.transpose(1, 2).float().contiguous() for t in (q, k, v, g, beta))
    q, k = _l2norm(q), _l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                               state: torch.Tensor | None, tiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One token a sequence: q, k [S, 1, Hk, Dk], v [S, 1, Hv, Dv], g, beta [S, 1, Hv], state [S, Hv, Dk, Dv]
    -> out [S, 1, Hv, Dv] in v's dtype, new state (float32)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, tiled)
    q, k, v, g, beta = q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0]
    s = state.float() if state is not None else q.new_zeros(*v.shape[:2], k.shape[-1], v.shape[-1])
    s = s * g.exp()[..., None, None]
    memory = (s * k.unsqueeze(-1)).sum(dim=-2)  # [S, Hv, Dv]
    delta = (v - memory) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (s * q.unsqueeze(-1)).sum(dim=-2)
    return out.unsqueeze(1).to(dtype), s


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor | None, tiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk of L positions a sequence, solved CHUNK at a time: shapes as `recurrent_gated_delta_rule`
    with L for 1. Positions with g = 0 and beta = 0 (padding) leave the state as it was."""
    dtype, length = v.dtype, q.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta, tiled)
    pad = (CHUNK - length % CHUNK) % CHUNK
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    num_seqs, heads, dv = v.shape[0], v.shape[1], v.shape[-1]
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (t.reshape(num_seqs, heads, -1, CHUNK, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    cum = g.reshape(num_seqs, heads, -1, CHUNK).cumsum(dim=-1)  # [S, H, N, C] log decay from the block start
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pair = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    s = state.float() if state is not None else q.new_zeros(num_seqs, heads, k.shape[-1], dv)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    block_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_values)
    for i in range(new_values.shape[2]):  # a scan over blocks of CHUNK positions, not over tokens
        v_new = new_values[:, :, i] - k_cum[:, :, i] @ s
        out[:, :, i] = q[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * block_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(num_seqs, heads, -1, dv)[:, :, :length]
    return out.transpose(1, 2).to(dtype).contiguous(), s


def split_qwen3_next_projections(weights: dict[str, torch.Tensor], recipe: GatedDeltaNetRecipe) -> None:
    """Qwen3-Next's `in_proj_qkvz` [Hk * (2Dk + 2 Dv G), H] and `in_proj_ba` [Hk * 2G, H] (G = Hv / Hk,
    grouped per key head) -> Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, in place."""
    r = recipe
    groups = r.num_v_heads // r.num_k_heads
    for name in [n for n in weights if n.endswith("in_proj_qkvz.weight")]:
        stem = name[:-len("in_proj_qkvz.weight")]
        qkvz = weights.pop(name).unflatten(0, (r.num_k_heads, -1))
        q, k, v, z = qkvz.split((r.head_k_dim, r.head_k_dim, groups * r.head_v_dim, groups * r.head_v_dim), dim=1)
        weights[stem + "in_proj_qkv.weight"] = torch.cat([t.flatten(0, 1) for t in (q, k, v)])
        weights[stem + "in_proj_z.weight"] = z.flatten(0, 1)
    # apart: llama.cpp's converter splits in_proj_qkvz itself (attn_qkv, attn_gate) but keeps in_proj_ba (ssm_ba)
    for name in [n for n in weights if n.endswith("in_proj_ba.weight")]:
        stem = name[:-len("in_proj_ba.weight")]
        ba = weights.pop(name).unflatten(0, (r.num_k_heads, -1))
        b, a = ba.split((groups, groups), dim=1)
        weights[stem + "in_proj_b.weight"], weights[stem + "in_proj_a.weight"] = b.flatten(0, 1), a.flatten(0, 1)
