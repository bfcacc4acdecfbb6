"""Qwen3.5 / Qwen3.6 MoE (`qwen3_5_moe_text`, also the text part of a `qwen3_5_moe` checkpoint, e.g.
Qwen3.6-35B-A3B): the Qwen3-Next hybrid whose every layer is MoE, top-k always renormalised, with a
gated shared expert."""

from __future__ import annotations

from dataclasses import dataclass

from mlxcel.models._moe import MoEArgs
from mlxcel.models.qwen3_next import (GGUF_LAYER_NAMES, MTP_HEAD_PREFIXES, MTP_LAYERS_PREFIX, HybridArgs, HybridLM,
                                      fix_gguf_weights, gguf_config)


@dataclass(frozen=True)
class ModelArgs(MoEArgs, HybridArgs):
    MOE_OPTIONS = {"shared_name": "shared_expert", "is_shared_gated": True, "normalize": True}


class Model(HybridLM):
    ARGS = ModelArgs


__all__ = ["GGUF_LAYER_NAMES", "MTP_HEAD_PREFIXES", "MTP_LAYERS_PREFIX", "Model", "ModelArgs", "fix_gguf_weights",
           "gguf_config"]  # its GGUF and MTP hooks: Qwen3-Next's
