"""Mixtral: the Mistral recipe with a sparse MoE block (`block_sparse_moe`) in every layer: softmax
router, top-k renormalised; experts stored per expert as w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from dataclasses import dataclass

from mlxcel.models import mistral
from mlxcel.models._gguf import unpermute_qk
from mlxcel.models._moe import GGUF_MOE_NAMES, MoEArgs, MoEDecoderLM

# llama.cpp writes Mixtral as "llama" with experts (models/llama.py `gguf_config` sends it here): its
# MoE tensors under our block's name, and the Llama q/k row permutation.
GGUF_LAYER_NAMES = {part: name.replace("mlp.", "block_sparse_moe.", 1) for part, name in GGUF_MOE_NAMES.items()}
fix_gguf_weights = unpermute_qk


@dataclass(frozen=True)
class ModelArgs(MoEArgs, mistral.ModelArgs):
    rope_theta: float = 1e6

    MOE_OPTIONS = {"normalize": True}
    MOE_BLOCK = "block_sparse_moe"


class Model(MoEDecoderLM):
    ARGS = ModelArgs
    MOE_LAYOUT = "mixtral"
