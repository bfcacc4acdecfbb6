"""Llama family (Llama 2/3, SmolLM2, ...): the shared decoder's plain recipe (layers/decoder.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mlxcel.layers.decoder import DecoderArgs, DecoderLM

if TYPE_CHECKING:
    from mlxcel.models._gguf import GGUFTensors


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    rms_norm_eps: float = 1e-5

    def layer_window(self, layer_idx: int) -> int | None:
        return None


class Model(DecoderLM):
    ARGS = ModelArgs


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    # llama.cpp's converter interleaves each head's rotary halves; HF keeps them split.
    head_dim = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, head_dim, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    """Llama 3.x GGUFs carry their rope scaling as a `rope_freqs` tensor, not as metadata."""
    if "rope_freqs.weight" in gguf.tensors:
        factors = gguf.dequantize("rope_freqs.weight").reshape(-1).tolist()
        config = {**config, "rope_scaling": {"rope_type": "freq_factors", "factors": factors}}
    return config


def fix_gguf_weights(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Undo the q/k row permutation that GGUF applies to Llama attention weights."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    for name in list(state):
        if name.endswith("self_attn.q_proj.weight"):
            state[name] = _unpermute(state[name], heads)
        elif name.endswith("self_attn.k_proj.weight"):
            state[name] = _unpermute(state[name], kv_heads)
    return state
