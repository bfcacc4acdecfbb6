"""Qwen2 / Qwen2.5 family: the Llama recipe with q/k/v biases and optional sliding-window layers."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from mlxcel.layers.decoder import FULL, SLIDING, AttentionRecipe, DecoderArgs, DecoderLM


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    max_position_embeddings: int = 32768
    use_sliding_window: bool = False
    max_window_layers: int = 28

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = super().prepare(config)
        if not config.get("use_sliding_window"):  # as transformers does: the window is then unused
            config["sliding_window"] = None
        if config.get("layer_types") is None:
            layers = config["num_hidden_layers"]
            config["layer_types"] = [SLIDING if i >= config.get("max_window_layers", 28) else FULL
                                     for i in range(layers)]
        return config

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        recipe = super().attention_recipe(layer_idx)
        return replace(recipe, q_bias=True, kv_bias=True, o_bias=False)


class Model(DecoderLM):
    ARGS = ModelArgs
