"""GLM-4.5 / GLM-4.6 (glm4_moe): pre-norm layers with q/k/v biases, optional per-head q/k norms and
partial (half) rotary with halves rotated; the first `first_k_dense_replace` layers dense, the others
DeepSeek-V3's MoE: sigmoid scores, a selection-only correction bias, grouped top-k, renormalised,
times `routed_scaling_factor`, plus ungated shared experts.

GGUF (llama.cpp's `glm4moe`, issue 40): the converter counts the MTP layers in `block_count` (their
tensors follow the decoder's, and are dropped here), keeps the MoE settings under llama.cpp's keys
(`_moe.deepseek_moe_gguf_config`) and the rotated dimensions as `rope.dimension_count`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs
from mlxcel.models._gguf import GGUFTensors, has_layer_tensor
from mlxcel.models._moe import GGUF_MOE_NAMES, GGUF_SHARED_EXPERT_NAMES, MoEArgs, MoEDecoderLM, deepseek_moe_gguf_config

GGUF_LAYER_NAMES = {**GGUF_MOE_NAMES, **GGUF_SHARED_EXPERT_NAMES, "post_attention_norm": "post_attention_layernorm"}


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


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    num_mtp = config.get("num_nextn_predict_layers") or 0
    return {**config, **deepseek_moe_gguf_config(gguf), "num_hidden_layers": config["num_hidden_layers"] - num_mtp,
            "attention_bias": has_layer_tensor(gguf, "attn_q.bias"),
            "use_qk_norm": has_layer_tensor(gguf, "attn_q_norm.weight")}
