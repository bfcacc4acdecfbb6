"""The batch-1 MTP decision (F10): may decoding draft with the checkpoint's own next-token heads?

A checkpoint with multi-token-prediction layers (DeepSeek-V3 and GLM-4.5's
`num_nextn_predict_layers`, transformers' `num_mtp_layers`, Qwen3-Next's
`mtp_num_hidden_layers`, GGUF's `<arch>.nextn_predict_layers`) can draft its own next tokens for
the speculative path (engine/spec). Every such architecture in transformers and GGUF is a
mixture-of-experts, MLA or hybrid linear-attention model (MiMo's dense `mimo` family ships only as
remote code); the families the engine runs (models/: llama, qwen2, qwen3, gemma3) have no MTP
layers, so the decision is `unavailable` with the reason, whether the config declares no heads or
declares heads its family does not load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlxcel.types import MtpDecision

# Config keys that count a checkpoint's MTP layers, in the spellings the checkpoints use.
MTP_LAYER_KEYS = ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers")


def declared_mtp_layers(config: Mapping[str, Any]) -> tuple[int, str | None]:
    """How many MTP layers `config` declares, and under which key (a VLM's `text_config` counts)."""
    for section in (config, config.get("text_config") or {}):
        for key in MTP_LAYER_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, key
    return 0, None


def decide_mtp(config: Mapping[str, Any]) -> MtpDecision:
    """The decision for a loaded checkpoint's config (`model_type` names its family)."""
    num_layers, key = declared_mtp_layers(config)
    family = str(config.get("model_type", "unknown"))
    if not num_layers:
        return MtpDecision("unavailable", f"the checkpoint has no MTP heads: its config declares none "
                                          f"({', '.join(MTP_LAYER_KEYS)} absent or 0)")
    return MtpDecision("unavailable", f"the checkpoint declares {num_layers} MTP layer(s) ({key}), but the engine's "
                                      f"{family} family does not load MTP layers, so they cannot draft",
                       num_mtp_layers=num_layers)
