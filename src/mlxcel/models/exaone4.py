"""LG EXAONE 4.0: norms after attention and MLP only, per-head q/k RMSNorm before rope, and
(with a sliding window) local layers with rope interleaved with global layers without rope."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs, DecoderLM, RopeRecipe
from mlxcel.models._gguf import sliding_layer_types
from mlxcel.models.olmo2 import GGUF_LAYER_NAMES, POST_NORMS

if TYPE_CHECKING:
    from mlxcel.models._gguf import GGUFTensors


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    rms_norm_eps: float = 1e-5

    NORM_NAMES: ClassVar[Mapping[str, str]] = POST_NORMS

    def layer_rope(self, layer_idx: int) -> RopeRecipe | None:
        # transformers: rope where there is no window at all, or on the sliding layers only.
        if self.sliding_window is None or self.is_sliding(layer_idx):
            return super().layer_rope(layer_idx)
        return None

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return replace(super().attention_recipe(layer_idx), qk_norm="head")


class Model(DecoderLM):
    ARGS = ModelArgs


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    """As llama.cpp reads it: a pattern in the file, else every 4th layer global for the 32B (64
    layers) alone; without sliding layers every layer has rope and no window."""
    layers = config["num_hidden_layers"]
    layer_types = sliding_layer_types(gguf, layers, 4 if layers == 64 else None)
    if layer_types is None:
        return {**config, "sliding_window": None, "layer_types": None}
    return {**config, "sliding_window": config.get("sliding_window") or 4096, "layer_types": layer_types}


__all__ = ["GGUF_LAYER_NAMES", "Model", "ModelArgs", "gguf_config"]
