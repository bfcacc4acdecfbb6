"""Qwen3 (dense) family: the Qwen2 recipe without biases, with per-head RMSNorm on q and k before rope."""

from __future__ import annotations

from dataclasses import dataclass, replace

from mlxcel.layers.decoder import AttentionRecipe, DecoderLM
from mlxcel.models import qwen2


@dataclass(frozen=True)
class ModelArgs(qwen2.ModelArgs):
    head_dim: int | None = 128  # transformers' default when a config leaves it out

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        recipe = super().attention_recipe(layer_idx)
        bias = self.attention_bias
        return replace(recipe, q_bias=bias, kv_bias=bias, o_bias=bias, qk_norm="head")


class Model(DecoderLM):
    ARGS = ModelArgs
