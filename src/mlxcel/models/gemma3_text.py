"""`gemma3_text` is the model_type of HF Gemma 3 text-only checkpoints; the family lives in gemma3."""

from __future__ import annotations

from mlxcel.models.gemma3 import ModelArgs, Model

__all__ = ["Model", "ModelArgs"]
