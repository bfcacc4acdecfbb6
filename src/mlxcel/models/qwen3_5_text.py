"""Qwen3.5 / Qwen3.6 dense (`qwen3_5_text`, also the text part of a `qwen3_5` checkpoint): the
Qwen3-Next hybrid (models/qwen3_next.py) with a dense MLP in every layer."""

from __future__ import annotations

from dataclasses import dataclass

from mlxcel.models.qwen3_next import (GGUF_LAYER_NAMES, MTP_HEAD_PREFIXES, MTP_LAYERS_PREFIX, HybridArgs, HybridLM,
                                      fix_gguf_weights, gguf_config)


@dataclass(frozen=True)
class ModelArgs(HybridArgs):
    pass


class Model(HybridLM):
    ARGS = ModelArgs


__all__ = ["GGUF_LAYER_NAMES", "MTP_HEAD_PREFIXES", "MTP_LAYERS_PREFIX", "Model", "ModelArgs", "fix_gguf_weights",
           "gguf_config"]  # its GGUF and MTP hooks: Qwen3-Next's
