"""What a family's GGUF hooks may read of a GGUF file, and the layout fixes several families share.

loading/gguf.py's `GGUFFile` satisfies `GGUFTensors`, so a family module never imports loading/
(loading -> models only). A family's hooks (issue 40):
    gguf_config(config, gguf) -> config      settings llama.cpp stores under its own keys or fixes in code
    fix_gguf_weights(state, config) -> state  layouts the converter changed (only moving rows of a weight)
    GGUF_LAYER_NAMES                          per-layer tensor names that differ from Llama's
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import torch

SLIDING, FULL = "sliding_attention", "full_attention"  # as layers/decoder.py spells them


class GGUFTensors(Protocol):
    """A GGUF file's tensor table, its `<arch>.` metadata and its dequantizer."""

    @property
    def tensors(self) -> Mapping[str, Any]: ...

    def arch_value(self, key: str, default: Any = None) -> Any: ...

    def dequantize(self, name: str) -> np.ndarray: ...


def has_layer_tensor(gguf: GGUFTensors, part: str) -> bool:
    """Whether layer 0 holds `blk.0.{part}` (biases and optional norms are known only this way)."""
    return f"blk.0.{part}" in gguf.tensors


def sliding_layer_types(gguf: GGUFTensors, num_layers: int, default_period: int | None) -> list[str] | None:
    """HF `layer_types` from `attention.sliding_window_pattern`: a per-layer bool array, or a period n
    (every n-th layer global, as llama.cpp's `set_swa_pattern`); `default_period` where the key is
    absent (llama.cpp's value for the architecture), None: no sliding layers."""
    pattern = gguf.arch_value("attention.sliding_window_pattern", default_period)
    if pattern is None:
        return None
    if isinstance(pattern, (list, tuple)):
        return [SLIDING if bool(p) else FULL for p in pattern]
    period = int(pattern)
    return [SLIDING if (i + 1) % period else FULL for i in range(num_layers)]


def unpermute_qk(state: dict[str, torch.Tensor], config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Undo the q/k row permutation llama.cpp's converter applies to Llama-style attention
    (`LlamaModel.permute`: each head's rotary halves interleaved); weights and biases alike."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    for name in list(state):
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            state[name] = _unpermute(state[name], heads)
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            state[name] = _unpermute(state[name], kv_heads)
    return state


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    head_dim = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, head_dim, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unshift_norms(state: dict[str, torch.Tensor], config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The converter stores every Gemma (1 + w) norm as 1 + w; the HF weight is w."""
    for name in list(state):
        if name.endswith("norm.weight"):
            state[name] = state[name] - 1.0
    return state
