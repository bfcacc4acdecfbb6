"""IBM Granite (3.x dense): the Llama recipe with Granite's four multipliers: embeddings times
`embedding_multiplier`, attention scale `attention_multiplier`, each residual branch times
`residual_multiplier`, logits divided by `logits_scaling`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs, DecoderLM, LayerRecipe
from mlxcel.models._gguf import unpermute_qk

if TYPE_CHECKING:
    from mlxcel.models._gguf import GGUFTensors


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


# GGUF key (after "granite.") -> Granite's multiplier; the converter renames each `_multiplier` `_scale`.
GGUF_MULTIPLIERS = {"attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
                    "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    found = {hf: value for key, hf in GGUF_MULTIPLIERS.items() if (value := gguf.arch_value(key)) is not None}
    return {**config, **found}


fix_gguf_weights = unpermute_qk  # converted as a LlamaModel: q/k rows permuted
