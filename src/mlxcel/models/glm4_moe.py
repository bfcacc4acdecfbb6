"""GLM-4.5 / GLM-4.6 (glm4_moe): pre-norm layers with q/k/v biases, optional per-head q/k norms and
partial (half) rotary with halves rotated; the first `first_k_dense_replace` layers dense, the others
DeepSeek-V3's MoE: sigmoid scores, a selection-only correction bias, grouped top-k, renormalised,
times `routed_scaling_factor`, plus ungated shared experts."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs
from mlxcel.models._moe import MoEArgs, MoEDecoderLM


@dataclass(frozen=True)
class ModelArgs(MoEArgs, DecoderArgs):
    rms_norm_eps: float = 1e-5
    partial_rotary_factor: float = 0.5
    use_qk_norm: bool = False
    first_k_dense_replace: int = 1

    MOE_ROUTER = "sigmoid_grouped"

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        # transformers 5 keeps the factor inside rope_parameters
        factor = config.get("partial_rotary_factor") or (config.get("rope_parameters") or {}).get("partial_rotary_factor")
        return super().prepare({**config, "partial_rotary_factor": factor or 0.5})

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return replace(super().attention_recipe(layer_idx), o_bias=False,
                       qk_norm="head" if self.use_qk_norm else None)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace


class Model(MoEDecoderLM):
    ARGS = ModelArgs
