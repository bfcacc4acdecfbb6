"""Multi-head latent attention (DeepSeek-V2 / V3, Kimi K2, GLM-4.5-style MLA), over the paged cache.

The checkpoint projects each token to a compressed latent `c` [kv_lora_rank] (RMS-normed) and one
shared rotary key `k_pe` [rope_dim]; `kv_b_proj` expands the latent into every head's no-rope key
[nope_dim] and value [v_dim]. The cache keeps only the latent and the rotary key, one "head" of
kv_lora_rank + rope_dim a token, and the projections are absorbed into the query and the output:

    score_h = (q_nope_h W_UK_h) . c + q_pe_h . k_pe          (= q_h . k_h of the expanded form)
    out_h   = (sum_j p_hj c_j) W_UV_h                          (= sum_j p_hj v_hj)

so attention runs as multi-query attention with queries [H, kv_lora_rank + rope_dim] over one
key head. The latent is the key and also the value (the output keeps its first kv_lora_rank
dimensions); a family says so (`kv_values_are_keys`) and the engine's KV cache then stores it once
(`KVCache.values_are_keys`: kv_lora_rank + rope_dim a token, 576 values for DeepSeek-V3, against
128 heads x (192 + 128) expanded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mlxcel.layers.attention import AttentionContext
from mlxcel.layers.decoder import NormRecipe, Rope, RopeRecipe
from mlxcel.layers.quant import linear


@dataclass(frozen=True)
class MLARecipe:
    num_heads: int
    q_lora_rank: int | None  # None: one q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int
    nope_dim: int  # qk_nope_head_dim
    rope_dim: int  # qk_rope_head_dim
    v_dim: int
    scale: float  # softmax scale of the expanded form (qk_head_dim ** -0.5, times yarn's mscale squared)
    rope: RopeRecipe
    bias: bool = False

    @property
    def head_dim(self) -> int:
        """The width the rotary table turns (the shared rotary key's)."""
        return self.rope_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def build(self, hidden_size: int, layer_idx: int, rope: Rope | None, norm: NormRecipe) -> nn.Module:
        assert rope is not None
        return LatentAttention(hidden_size, self, layer_idx, rope, norm)


class _Weight(nn.Module):
    """`kv_b_proj`: read as a matrix (split and absorbed), never called, so no rewrite packs it."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


class LatentAttention(nn.Module):
    def __init__(self, hidden_size: int, recipe: MLARecipe, layer_idx: int, rope: Rope, norm: NormRecipe) -> None:
        super().__init__()
        r = self.recipe = recipe
        self.layer_idx, self.num_heads = layer_idx, r.num_heads
        qk_dim = r.nope_dim + r.rope_dim
        if r.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, r.num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, r.q_lora_rank, bias=r.bias)
            self.q_a_layernorm = norm.build(r.q_lora_rank)
            self.q_b_proj = nn.Linear(r.q_lora_rank, r.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, r.kv_lora_rank + r.rope_dim, bias=r.bias)
        self.kv_a_layernorm = norm.build(r.kv_lora_rank)
        self.kv_b_proj = _Weight(r.num_heads * (r.nope_dim + r.v_dim), r.kv_lora_rank)
        self.o_proj = nn.Linear(r.num_heads * r.v_dim, hidden_size, bias=r.bias)
        self.rope = [rope]

    def _absorbed(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, rank] and W_UV [H, rank, v] from kv_b_proj (in the activations' dtype)."""
        r = self.recipe
        w = self.kv_b_proj.weight.to(dtype).view(r.num_heads, r.nope_dim + r.v_dim, r.kv_lora_rank)
        return w[:, :r.nope_dim], w[:, r.nope_dim:].transpose(1, 2)

    def _queries(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        if self.recipe.q_lora_rank is None:
            return linear(self.q_proj, x, ctx)
        return linear(self.q_b_proj, self.q_a_layernorm(linear(self.q_a_proj, x, ctx)), ctx)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        r, t = self.recipe, x.shape[0]
        q = self._queries(x, ctx).view(t, r.num_heads, r.nope_dim + r.rope_dim)
        q_nope, q_pe = q.split((r.nope_dim, r.rope_dim), dim=-1)
        latent, k_pe = linear(self.kv_a_proj_with_mqa, x, ctx).split((r.kv_lora_rank, r.rope_dim), dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_pe, k_pe = self.rope[0](q_pe, k_pe.view(t, 1, r.rope_dim), positions)
        w_uk, w_uv = self._absorbed(q.dtype)
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # [T, H, rank]
        queries = torch.cat((q_latent, q_pe), dim=-1)  # [T, H, rank + rope]
        keys = torch.cat((latent.view(t, 1, r.kv_lora_rank), k_pe), dim=-1)  # [T, 1, rank + rope]
        out = ctx.attend(self.layer_idx, queries, keys, keys, scale=r.scale)[..., :r.kv_lora_rank]
        out = torch.einsum("thr,hrv->thv", out, w_uv)  # [T, H, v]
        return linear(self.o_proj, out.reshape(t, -1), ctx)
