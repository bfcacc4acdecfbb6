"""`qwen3moe` is llama.cpp's GGUF architecture name for Qwen3-MoE; the family lives in qwen3_moe."""

from __future__ import annotations

from mlxcel.models.qwen3_moe import GGUF_LAYER_NAMES, Model, ModelArgs, gguf_config

__all__ = ["GGUF_LAYER_NAMES", "Model", "ModelArgs", "gguf_config"]
