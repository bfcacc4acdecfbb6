"""Mistral family (Mistral 7B, Mistral Small / Nemo text): the Llama recipe with an optional sliding
window on every layer (transformers' MistralAttention takes `sliding_window` for all layers)."""

from __future__ import annotations

from dataclasses import dataclass

from mlxcel.layers.decoder import DecoderArgs, DecoderLM


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 32768

    def layer_window(self, layer_idx: int) -> int | None:
        return self.sliding_window or None


class Model(DecoderLM):
    ARGS = ModelArgs
