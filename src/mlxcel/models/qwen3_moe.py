"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, ...): the Qwen3 recipe whose sparse layers hold a
softmax-routed MoE, top-k renormalised when `norm_topk_prob`; no shared expert."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlxcel.models import qwen3
from mlxcel.models._moe import GGUF_MOE_NAMES, MoEArgs, MoEDecoderLM, is_sparse_layer

if TYPE_CHECKING:
    from mlxcel.models._gguf import GGUFTensors

GGUF_LAYER_NAMES = GGUF_MOE_NAMES


@dataclass(frozen=True)
class ModelArgs(MoEArgs, qwen3.ModelArgs):
    def is_moe_layer(self, layer_idx: int) -> bool:
        return is_sparse_layer(self, layer_idx)


class Model(MoEDecoderLM):
    ARGS = ModelArgs


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    """llama.cpp's qwen3moe always renormalises the top-k weights (Qwen3-MoE's norm_topk_prob)."""
    return {"norm_topk_prob": True, **config}
