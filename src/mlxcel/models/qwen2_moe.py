"""Qwen1.5-MoE / Qwen2-MoE: the Qwen2 recipe whose sparse layers (every `decoder_sparse_step`-th, not
in `mlp_only_layers`) hold a softmax-routed MoE plus one shared expert gated by
sigmoid(`shared_expert_gate`(x))."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs, DecoderLM, LayerRecipe
from mlxcel.layers.moe import moe_spec_from_config, sanitize_moe
from mlxcel.models import qwen2
from mlxcel.models._moe import config_of, is_sparse_layer, moe_layer


@dataclass(frozen=True)
class ModelArgs(qwen2.ModelArgs):
    qkv_bias: bool = True

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return replace(super().attention_recipe(layer_idx), q_bias=self.qkv_bias, kv_bias=self.qkv_bias)

    def layer_recipe(self, layer_idx: int) -> LayerRecipe:
        recipe = super().layer_recipe(layer_idx)
        if not is_sparse_layer(self, layer_idx):
            return recipe
        spec = moe_spec_from_config(config_of(self), "softmax", shared_name="shared_expert", is_shared_gated=True)
        return moe_layer(recipe, spec)


class Model(DecoderLM):
    ARGS = ModelArgs

    @classmethod
    def sanitize(cls, weights: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        return super().sanitize(sanitize_moe(weights, "per_expert"), args)
