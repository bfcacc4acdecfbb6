"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, ...): the Qwen3 recipe whose sparse layers hold a
softmax-routed MoE, top-k renormalised when `norm_topk_prob`; no shared expert."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlxcel.layers.decoder import DecoderArgs, DecoderLM, LayerRecipe
from mlxcel.layers.moe import moe_spec_from_config, sanitize_moe
from mlxcel.models import qwen3
from mlxcel.models._moe import config_of, is_sparse_layer, moe_layer


@dataclass(frozen=True)
class ModelArgs(qwen3.ModelArgs):
    def layer_recipe(self, layer_idx: int) -> LayerRecipe:
        recipe = super().layer_recipe(layer_idx)
        if not is_sparse_layer(self, layer_idx):
            return recipe
        return moe_layer(recipe, moe_spec_from_config(config_of(self), "softmax"))


class Model(DecoderLM):
    ARGS = ModelArgs

    @classmethod
    def sanitize(cls, weights: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        return super().sanitize(sanitize_moe(weights, "per_expert"), args)
