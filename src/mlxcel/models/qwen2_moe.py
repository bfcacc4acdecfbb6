"""Qwen1.5-MoE / Qwen2-MoE: the Qwen2 recipe whose sparse layers (every `decoder_sparse_step`-th, not
in `mlp_only_layers`) hold a softmax-routed MoE plus one shared expert gated by
sigmoid(`shared_expert_gate`(x))."""

from __future__ import annotations

from dataclasses import dataclass, replace

from mlxcel.layers.decoder import AttentionRecipe
from mlxcel.models import qwen2
from mlxcel.models._moe import MoEArgs, MoEDecoderLM, is_sparse_layer


@dataclass(frozen=True)
class ModelArgs(MoEArgs, qwen2.ModelArgs):
    qkv_bias: bool = True

    MOE_OPTIONS = {"shared_name": "shared_expert", "is_shared_gated": True}

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return replace(super().attention_recipe(layer_idx), q_bias=self.qkv_bias, kv_bias=self.qkv_bias)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return is_sparse_layer(self, layer_idx)


class Model(MoEDecoderLM):
    ARGS = ModelArgs
