"""Mixtral: the Mistral recipe with a sparse MoE block (`block_sparse_moe`) in every layer: softmax
router, top-k renormalised; experts stored per expert as w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from dataclasses import dataclass

from mlxcel.models import mistral
from mlxcel.models._moe import MoEArgs, MoEDecoderLM


@dataclass(frozen=True)
class ModelArgs(MoEArgs, mistral.ModelArgs):
    rope_theta: float = 1e6

    MOE_OPTIONS = {"normalize": True}
    MOE_BLOCK = "block_sparse_moe"


class Model(MoEDecoderLM):
    ARGS = ModelArgs
    MOE_LAYOUT = "mixtral"
