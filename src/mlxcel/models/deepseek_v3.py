"""DeepSeek-V3 / R1 (and Kimi K2, the same shape): multi-head latent attention (layers/mla.py, the
latent KV cache with absorbed projections), dense MLPs in the first `first_k_dense_replace`
layers and sigmoid-routed experts with shared experts in the rest (layers/moe.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlxcel.layers.decoder import DecoderArgs, RopeRecipe
from mlxcel.layers.mla import MLARecipe
from mlxcel.layers.rope import rope_type
from mlxcel.models._moe import MoEArgs, MoEDecoderLM


@dataclass(frozen=True)
class ModelArgs(MoEArgs, DecoderArgs):
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    first_k_dense_replace: int = 3
    n_routed_experts: int | None = 256
    moe_intermediate_size: int = 2048

    MOE_ROUTER = "sigmoid_grouped"

    @property
    def kv_heads(self) -> int:
        return 1  # the cache holds one latent "head" a token

    @property
    def dim_per_head(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kv_values_are_keys(self) -> bool:
        return True  # the latent is attended as key and as value: the cache stores it once

    def softmax_scale(self) -> float:
        """qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) squared (as DeepSeek scales it)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        scaling = self.rope_scaling or {}
        if rope_type(scaling) != "default" and scaling.get("mscale_all_dim"):
            mscale = 0.1 * float(scaling["mscale_all_dim"]) * math.log(float(scaling["factor"])) + 1.0
            scale *= mscale * mscale
        return scale

    def layer_rope(self, layer_idx: int) -> RopeRecipe:
        return RopeRecipe.of(self.rope_theta, self.rope_scaling, self.qk_rope_head_dim,
                             interleaved=self.rope_interleave)

    def attention_recipe(self, layer_idx: int) -> MLARecipe:  # type: ignore[override]
        return MLARecipe(self.num_attention_heads, self.q_lora_rank, self.kv_lora_rank, self.qk_nope_head_dim,
                         self.qk_rope_head_dim, self.v_head_dim, self.softmax_scale(), self.layer_rope(layer_idx),
                         bias=self.attention_bias)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return bool(self.n_routed_experts) and layer_idx >= self.first_k_dense_replace


class Model(MoEDecoderLM):
    ARGS = ModelArgs
