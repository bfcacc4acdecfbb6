"""Gemma 2: the Gemma recipe (sandwich (1 + w) norms, scaled embeddings, GELU, query_pre_attn_scalar)
without q/k norms, with soft-capped attention scores and logits, and one rope for every layer;
sliding and global layers alternate."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mlxcel.layers.decoder import AttentionRecipe, DecoderLM, RopeRecipe
from mlxcel.models import gemma3
from mlxcel.models._gguf import unshift_norms

if TYPE_CHECKING:
    from mlxcel.models._gguf import GGUFTensors


@dataclass(frozen=True)
class ModelArgs(gemma3.ModelArgs):
    rope_theta: float = 10_000.0
    max_position_embeddings: int = 8192
    attn_logit_softcapping: float | None = 50.0
    final_logit_softcapping: float | None = 30.0

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        return super().prepare({"sliding_window_pattern": 2, **config})

    def layer_rope(self, layer_idx: int) -> RopeRecipe:
        return RopeRecipe.of(self.rope_theta, self.rope_scaling, self.dim_per_head)

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return replace(super().attention_recipe(layer_idx), qk_norm=None)


class Model(gemma3.Model):
    ARGS = ModelArgs


GGUF_LAYER_NAMES = gemma3.GGUF_LAYER_NAMES


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    """llama.cpp fixes the query scale in code (by the 27B's 46 layers); the converter writes no rope
    base (llama.cpp's default 10000 is Gemma 2's)."""
    return {"rope_theta": 10_000.0, **config, "query_pre_attn_scalar": gemma3.gemma_query_scalar(config, 46)}


fix_gguf_weights = unshift_norms  # the converter stores (1 + w)
