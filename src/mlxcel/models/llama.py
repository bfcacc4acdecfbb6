"""Llama family (Llama 2/3, SmolLM2, ...): the shared decoder's plain recipe (layers/decoder.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlxcel.layers.decoder import DecoderArgs, DecoderLM
from mlxcel.models._gguf import unpermute_qk

if TYPE_CHECKING:
    from mlxcel.models._gguf import GGUFTensors


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    rms_norm_eps: float = 1e-5

    def layer_window(self, layer_idx: int) -> int | None:
        return None


class Model(DecoderLM):
    ARGS = ModelArgs


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    """Llama 3.x GGUFs carry their rope scaling as a `rope_freqs` tensor, not as metadata. llama.cpp
    writes Mixtral as "llama" with expert stacks (ffn_*_exps): that file loads as mixtral."""
    if "blk.0.ffn_gate_exps.weight" in gguf.tensors:
        config = {**config, "model_type": "mixtral"}
    if "rope_freqs.weight" in gguf.tensors:
        factors = gguf.dequantize("rope_freqs.weight").reshape(-1).tolist()
        config = {**config, "rope_scaling": {"rope_type": "freq_factors", "factors": factors}}
    return config


# llama.cpp's converter interleaves each head's rotary halves of q and k (its `permute`).
fix_gguf_weights = unpermute_qk
