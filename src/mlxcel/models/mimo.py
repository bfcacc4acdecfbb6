"""Xiaomi MiMo (`model_type` "mimo", MiMoForCausalLM): a Qwen2 model plus multi-token-prediction layers.

The main model is Qwen2's, parameter for parameter. The checkpoint's MTP layers
(`model.mtp_layers.N.*`: token/hidden norms, `input_proj`, a Qwen2 decoder layer, `final_layernorm`)
are no part of its forward: the speculative path reads them (engine/spec/mtp.py, F10).
"""

from __future__ import annotations

import torch

from mlxcel.models import qwen2
from mlxcel.models.qwen2 import ModelArgs

MTP_LAYERS_PREFIX = "model.mtp_layers."  # where the MTP layers' weights live in the checkpoint


class Model(qwen2.Model):
    """Qwen2's decoder-only LM; the MTP layers' weights are left for the drafter."""

    @staticmethod
    def sanitize(weights: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
        kept = {name: value for name, value in weights.items() if not name.startswith(MTP_LAYERS_PREFIX)}
        return qwen2.Model.sanitize(kept, args)


__all__ = ["MTP_LAYERS_PREFIX", "Model", "ModelArgs"]
