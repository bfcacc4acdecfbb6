"""Kimi K2 (Moonshot): DeepSeek-V3's architecture under its own `model_type` (its config.json names
DeepseekV3ForCausalLM); read and built exactly as deepseek_v3 (models/deepseek_v3.py)."""

from __future__ import annotations

from mlxcel.models.deepseek_v3 import Model, ModelArgs

__all__ = ["Model", "ModelArgs"]
