"""IBM Granite (3.x dense): the Llama recipe with Granite's four multipliers: embeddings times
`embedding_multiplier`, attention scale `attention_multiplier`, each residual branch times
`residual_multiplier`, logits divided by `logits_scaling`."""

from __future__ import annotations

from dataclasses import dataclass, replace

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs, DecoderLM, LayerRecipe


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    rms_norm_eps: float = 1e-6
    embedding_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @property
    def embed_scale(self) -> float | None:
        return self.embedding_multiplier if self.embedding_multiplier != 1.0 else None

    @property
    def logit_scale(self) -> float | None:
        return 1.0 / self.logits_scaling if self.logits_scaling != 1.0 else None

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return replace(super().attention_recipe(layer_idx), scale=self.attention_multiplier)

    def layer_recipe(self, layer_idx: int) -> LayerRecipe:
        return replace(super().layer_recipe(layer_idx), residual_multiplier=self.residual_multiplier)


class Model(DecoderLM):
    ARGS = ModelArgs
