"""OLMo 2: norms after attention and MLP only (no pre-norms), and RMSNorm over the whole q and k
projections (not per head) before rope."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs, DecoderLM

POST_NORMS = {"attn_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"}


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    rms_norm_eps: float = 1e-5

    NORM_NAMES: ClassVar[Mapping[str, str]] = POST_NORMS

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return replace(super().attention_recipe(layer_idx), qk_norm="full")


class Model(DecoderLM):
    ARGS = ModelArgs


# Norms after attention and MLP (llama.cpp's post_attention_norm / post_ffw_norm).
GGUF_LAYER_NAMES = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
