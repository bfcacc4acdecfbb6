"""OLMoE: the Llama layout with RMSNorm over the whole q and k projections (OLMo 2's q/k norm, before
rope) and a softmax-routed MoE in every layer."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs, DecoderLM, LayerRecipe
from mlxcel.layers.moe import moe_spec_from_config, sanitize_moe
from mlxcel.models._moe import config_of, moe_layer


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    rms_norm_eps: float = 1e-5

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        if config.get("clip_qkv") is not None:
            raise ValueError("clip_qkv (clamped q/k/v projections) is not supported")
        return super().prepare(config)

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return replace(super().attention_recipe(layer_idx), qk_norm="full")

    def layer_recipe(self, layer_idx: int) -> LayerRecipe:
        return moe_layer(super().layer_recipe(layer_idx), moe_spec_from_config(config_of(self), "softmax"))


class Model(DecoderLM):
    ARGS = ModelArgs

    @classmethod
    def sanitize(cls, weights: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        return super().sanitize(sanitize_moe(weights, "per_expert"), args)
