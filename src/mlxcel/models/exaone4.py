"""LG EXAONE 4.0: norms after attention and MLP only, per-head q/k RMSNorm before rope, and
(with a sliding window) local layers with rope interleaved with global layers without rope."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs, DecoderLM, RopeRecipe
from mlxcel.models.olmo2 import POST_NORMS


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
