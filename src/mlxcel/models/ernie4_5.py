"""Baidu ERNIE 4.5 (dense): the Llama recipe with neighbouring rotary dimensions paired and
biases on every projection where `use_bias` is set."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs, DecoderLM, MLPRecipe, RopeRecipe
from mlxcel.models._gguf import has_layer_tensor

if TYPE_CHECKING:
    from mlxcel.models._gguf import GGUFTensors


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    rms_norm_eps: float = 1e-5
    use_bias: bool = False

    def layer_rope(self, layer_idx: int) -> RopeRecipe:
        return replace(super().layer_rope(layer_idx), interleaved=True)

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        bias = self.use_bias
        return replace(super().attention_recipe(layer_idx), q_bias=bias, kv_bias=bias, o_bias=bias)

    def mlp_recipe(self, layer_idx: int) -> MLPRecipe:
        return replace(super().mlp_recipe(layer_idx), bias=self.use_bias)


class Model(DecoderLM):
    ARGS = ModelArgs


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    return {**config, "use_bias": has_layer_tensor(gguf, "attn_q.bias")}
