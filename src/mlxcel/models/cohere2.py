"""Cohere Command R7B / Command A (Cohere2): attention and MLP in parallel from one bias-free
LayerNorm, rope (neighbouring dimensions paired) on the sliding layers only, logits scaled by
`logit_scale`, tied embeddings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from mlxcel.layers.decoder import DecoderArgs, DecoderLM, LayerRecipe, NormRecipe, RopeRecipe
from mlxcel.models._gguf import sliding_layer_types

if TYPE_CHECKING:
    from mlxcel.models._gguf import GGUFTensors


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    layer_norm_eps: float = 1e-5
    logit_scale: float = 0.0625
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 8192

    NORM_NAMES: ClassVar[Mapping[str, str]] = {"attn_in": "input_layernorm"}

    def norm_recipe(self) -> NormRecipe:
        return NormRecipe("layer", self.layer_norm_eps, bias=False)

    def layer_rope(self, layer_idx: int) -> RopeRecipe | None:
        if not self.is_sliding(layer_idx):
            return None
        return replace(super().layer_rope(layer_idx), interleaved=True)

    def layer_recipe(self, layer_idx: int) -> LayerRecipe:
        return replace(super().layer_recipe(layer_idx), parallel=True)


class Model(DecoderLM):
    ARGS = ModelArgs


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    """`logit_scale` is its own key; every 4th layer is global unless the file gives a pattern (llama.cpp)."""
    layer_types = sliding_layer_types(gguf, config["num_hidden_layers"], 4)
    return {**config, "logit_scale": gguf.arch_value("logit_scale", 0.0625), "layer_types": layer_types}
