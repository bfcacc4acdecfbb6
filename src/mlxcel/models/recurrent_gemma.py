"""Google RecurrentGemma (Griffin): `block_types` cycled over the layers: recurrent blocks (conv +
RG-LRU, layers/rglru.py) and local attention (window `attention_window_size`, rope over half of
each head, biased output); each layer's `temporal_block` then its `mlp_block` (GeGLU, half of
`intermediate_size` wide, with biases). Gemma's (1 + w) RMSNorms (`temporal_pre_norm`,
`channel_pre_norm`, `final_norm`), embeddings times sqrt(hidden) rounded to bfloat16, logits soft-capped."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs, DecoderLM, LayerRecipe, MLPRecipe, NormRecipe
from mlxcel.layers.rglru import RGLRURecipe
from mlxcel.models._hybrid import rename_prefixes


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    lru_width: int | None = None
    attention_window_size: int = 2048
    conv1d_width: int = 4
    logits_soft_cap: float = 30.0
    hidden_activation: str = "gelu_pytorch_tanh"
    block_types: tuple[str, ...] = ("recurrent", "recurrent", "attention")
    tie_word_embeddings: bool = True

    NORM_NAMES = {"attn_in": "temporal_pre_norm", "mlp_in": "channel_pre_norm"}

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = super().prepare(config)
        rope = config.get("rope_parameters") or {}
        kinds = tuple((list(config.get("block_types") or cls.block_types) * config["num_hidden_layers"])
                      [:config["num_hidden_layers"]])
        return {**config, "block_types": kinds,
                "partial_rotary_factor": rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.5))}

    @property
    def embed_scale(self) -> float:
        # The reference keeps sqrt(hidden) as a bfloat16 buffer.
        return float(torch.tensor(self.hidden_size**0.5, dtype=torch.bfloat16, device="cpu"))

    @property
    def final_softcap(self) -> float | None:
        return self.logits_soft_cap

    def norm_recipe(self) -> NormRecipe:
        return NormRecipe("rms", self.rms_norm_eps, offset=1.0)

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return replace(super().attention_recipe(layer_idx), window=self.attention_window_size, o_bias=True)

    def mlp_recipe(self, layer_idx: int) -> MLPRecipe:
        return MLPRecipe(self.intermediate_size // 2, self.hidden_activation, bias=True)

    def layer_recipe(self, layer_idx: int) -> LayerRecipe:
        recipe = replace(super().layer_recipe(layer_idx), mlp_name="mlp_block", attention_name="temporal_block")
        if self.block_types[layer_idx] == "recurrent":
            lru = RGLRURecipe(self.lru_width or self.hidden_size, self.num_attention_heads, self.conv1d_width,
                              self.hidden_activation)
            return replace(recipe, attention=lru)
        return recipe


class Model(DecoderLM):
    ARGS = ModelArgs

    @classmethod
    def sanitize(cls, weights: dict[str, Any], args: DecoderArgs) -> dict[str, Any]:
        return super().sanitize(rename_prefixes(weights, {"model.final_norm.": "model.norm."}), args)
