"""ByteDance Seed-OSS: the Llama recipe with q/k/v biases (`attention_bias`) and the output
projection's own (`attention_out_bias`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs, DecoderLM
from mlxcel.models._gguf import has_layer_tensor

if TYPE_CHECKING:
    from mlxcel.models._gguf import GGUFTensors


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    attention_out_bias: bool = False

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return replace(super().attention_recipe(layer_idx), o_bias=self.attention_out_bias)


class Model(DecoderLM):
    ARGS = ModelArgs


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    """The file has no bias flags: the bias tensors it holds say which projections have one."""
    return {**config, "attention_bias": has_layer_tensor(gguf, "attn_q.bias"),
            "attention_out_bias": has_layer_tensor(gguf, "attn_output.bias")}


# llama.cpp's seed_oss names the norm before the MLP `post_attention_norm` (it has no `ffn_norm`).
GGUF_LAYER_NAMES = {"post_attention_norm": "post_attention_layernorm"}
