"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, ...): the Qwen3 recipe whose sparse layers hold a
softmax-routed MoE, top-k renormalised when `norm_topk_prob`; no shared expert."""

from __future__ import annotations

from dataclasses import dataclass

from mlxcel.models import qwen3
from mlxcel.models._moe import MoEArgs, MoEDecoderLM, is_sparse_layer


@dataclass(frozen=True)
class ModelArgs(MoEArgs, qwen3.ModelArgs):
    def is_moe_layer(self, layer_idx: int) -> bool:
        return is_sparse_layer(self, layer_idx)


class Model(MoEDecoderLM):
    ARGS = ModelArgs
