"""GLM-4 (0414): sandwich norms (`post_self_attn_layernorm`, `post_mlp_layernorm`), q/k/v biases,
partial (half) rotary with neighbouring dimensions paired, and one fused `gate_up_proj`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs, DecoderLM, RopeRecipe, split_fused
from mlxcel.models._gguf import has_layer_tensor

if TYPE_CHECKING:
    from mlxcel.models._gguf import GGUFTensors

GLM_NORMS = {"attn_in": "input_layernorm", "attn_out": "post_self_attn_layernorm",
             "mlp_in": "post_attention_layernorm", "mlp_out": "post_mlp_layernorm"}


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    partial_rotary_factor: float = 0.5
    rms_norm_eps: float = 1e-5

    NORM_NAMES: ClassVar[Mapping[str, str]] = GLM_NORMS

    def layer_rope(self, layer_idx: int) -> RopeRecipe:
        return replace(super().layer_rope(layer_idx), interleaved=True)

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return replace(super().attention_recipe(layer_idx), o_bias=False)


class Model(DecoderLM):
    ARGS = ModelArgs

    @classmethod
    def sanitize(cls, weights: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        split_fused(weights, "gate_up_proj", {"gate_proj": args.intermediate_size, "up_proj": None})
        return super().sanitize(weights, args)


# Sandwich norms under llama.cpp's names; `ffn_up` is the fused [gate; up] (split by `sanitize`).
GGUF_LAYER_NAMES = {"post_attention_norm": "post_self_attn_layernorm", "post_ffw_norm": "post_mlp_layernorm",
                    "ffn_up": "mlp.gate_up_proj"}


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    return {**config, "attention_bias": has_layer_tensor(gguf, "attn_q.bias")}
