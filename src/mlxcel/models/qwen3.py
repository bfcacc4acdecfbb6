"""Qwen3 (dense) family: the Qwen2 recipe without biases, with per-head RMSNorm on q and k before rope."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mlxcel.layers.decoder import AttentionRecipe, DecoderLM
from mlxcel.models import qwen2

if TYPE_CHECKING:
    from mlxcel.models._gguf import GGUFTensors


@dataclass(frozen=True)
class ModelArgs(qwen2.ModelArgs):
    head_dim: int | None = 128  # transformers' default when a config leaves it out

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        recipe = super().attention_recipe(layer_idx)
        bias = self.attention_bias
        return replace(recipe, q_bias=bias, kv_bias=bias, o_bias=bias, qk_norm="head")


class Model(DecoderLM):
    ARGS = ModelArgs


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    """GGUF leaves out `key_length` when heads split the hidden size evenly (llama.cpp's default)."""
    if "head_dim" not in config:
        config = {**config, "head_dim": config["hidden_size"] // config["num_attention_heads"]}
    return config
