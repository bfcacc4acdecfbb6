"""GLM-4.5 / GLM-4.6 (glm4_moe): pre-norm layers with q/k/v biases, optional per-head q/k norms and
partial (half) rotary with halves rotated; the first `first_k_dense_replace` layers dense, the others
DeepSeek-V3's MoE: sigmoid scores, a selection-only correction bias, grouped top-k, renormalised,
times `routed_scaling_factor`, plus ungated shared experts."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs, DecoderLM, LayerRecipe
from mlxcel.layers.moe import moe_spec_from_config, sanitize_moe
from mlxcel.models._moe import config_of, decoder_layers_only, moe_layer


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    rms_norm_eps: float = 1e-5
    partial_rotary_factor: float = 0.5
    use_qk_norm: bool = False
    first_k_dense_replace: int = 1

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        # transformers 5 keeps the factor inside rope_parameters
        factor = config.get("partial_rotary_factor") or (config.get("rope_parameters") or {}).get("partial_rotary_factor")
        return super().prepare({**config, "partial_rotary_factor": factor or 0.5})

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return replace(super().attention_recipe(layer_idx), o_bias=False,
                       qk_norm="head" if self.use_qk_norm else None)

    def layer_recipe(self, layer_idx: int) -> LayerRecipe:
        recipe = super().layer_recipe(layer_idx)
        if layer_idx < self.first_k_dense_replace:
            return recipe
        return moe_layer(recipe, moe_spec_from_config(config_of(self), "sigmoid_grouped"))


class Model(DecoderLM):
    ARGS = ModelArgs

    @classmethod
    def sanitize(cls, weights: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        kept = decoder_layers_only(weights, args.num_hidden_layers)
        return super().sanitize(sanitize_moe(kept, "per_expert"), args)
