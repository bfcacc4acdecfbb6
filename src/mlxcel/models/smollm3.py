"""SmolLM3: the Llama recipe where `no_rope_layers[i] == 0` marks a layer without rotary embedding
(NoPE, every 4th by default), and optional sliding windows by `layer_types`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxcel.layers.decoder import DecoderArgs, DecoderLM, RopeRecipe
from mlxcel.models._gguf import unpermute_qk


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    max_position_embeddings: int = 32768
    rope_theta: float = 2_000_000.0
    no_rope_layers: tuple[int, ...] | None = None
    no_rope_layer_interval: int = 4

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = super().prepare(config)
        if config.get("no_rope_layers") is None:
            interval = int(config.get("no_rope_layer_interval") or 4)
            config["no_rope_layers"] = [int((i + 1) % interval != 0) for i in range(config["num_hidden_layers"])]
        config["no_rope_layers"] = tuple(config["no_rope_layers"])
        if not config.get("use_sliding_window"):
            config["sliding_window"] = None
        return config

    def layer_rope(self, layer_idx: int) -> RopeRecipe | None:
        return super().layer_rope(layer_idx) if self.no_rope_layers[layer_idx] else None


class Model(DecoderLM):
    ARGS = ModelArgs


def gguf_config(config: dict[str, Any], gguf: object) -> dict[str, Any]:
    """llama.cpp fixes the no-rope step at 4 in code (`n_no_rope_layer_step`); the file has no key."""
    return {**config, "no_rope_layer_interval": 4}


fix_gguf_weights = unpermute_qk  # converted as a LlamaModel: q/k rows permuted
