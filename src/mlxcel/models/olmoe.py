"""OLMoE: the Llama layout with RMSNorm over the whole q and k projections (OLMo 2's q/k norm, before
rope) and a softmax-routed MoE in every layer."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs
from mlxcel.models._moe import GGUF_MOE_NAMES, MoEArgs, MoEDecoderLM

GGUF_LAYER_NAMES = GGUF_MOE_NAMES  # llama.cpp's olmoe: Llama's names and the MoE stacks, nothing permuted


@dataclass(frozen=True)
class ModelArgs(MoEArgs, DecoderArgs):
    rms_norm_eps: float = 1e-5

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        if config.get("clip_qkv") is not None:
            raise ValueError("clip_qkv (clamped q/k/v projections) is not supported")
        return super().prepare(config)

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return replace(super().attention_recipe(layer_idx), qk_norm="full")


class Model(MoEDecoderLM):
    ARGS = ModelArgs
