"""Ministral: the Mistral recipe, its sliding window on the layers `layer_types` marks."""

from __future__ import annotations

from dataclasses import dataclass

from mlxcel.layers.decoder import DecoderArgs, DecoderLM


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 32768


class Model(DecoderLM):
    ARGS = ModelArgs
