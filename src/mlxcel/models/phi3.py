"""Microsoft Phi-3 / Phi-3.5 / Phi-4-mini: the Llama recipe over fused `qkv_proj` and
`gate_up_proj` (split at load), partial rotary, longrope scaling and an optional window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mlxcel.layers.decoder import DecoderArgs, DecoderLM, split_fused

if TYPE_CHECKING:
    from mlxcel.models._gguf import GGUFTensors


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    rms_norm_eps: float = 1e-5

    def layer_window(self, layer_idx: int) -> int | None:
        return self.sliding_window or None


class Model(DecoderLM):
    ARGS = ModelArgs

    @classmethod
    def sanitize(cls, weights: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        q_rows, kv_rows = args.num_attention_heads * args.dim_per_head, args.kv_heads * args.dim_per_head
        split_fused(weights, "qkv_proj", {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows})
        split_fused(weights, "gate_up_proj", {"gate_proj": args.intermediate_size, "up_proj": None})
        return super().sanitize(weights, args)


# Fused as in the HF checkpoint (split by `sanitize`).
GGUF_LAYER_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    """longrope: the converter stores the factors as `rope_factors_long` / `rope_factors_short`
    tensors, the trained context and the attention factor as rope.scaling keys."""
    if "rope_factors_long.weight" not in gguf.tensors:
        return config
    scaling = {"rope_type": "longrope",
               "long_factor": gguf.dequantize("rope_factors_long.weight").reshape(-1).tolist(),
               "short_factor": gguf.dequantize("rope_factors_short.weight").reshape(-1).tolist(),
               "original_max_position_embeddings": gguf.arch_value("rope.scaling.original_context_length"),
               "max_position_embeddings": config.get("max_position_embeddings")}
    if (attn_factor := gguf.arch_value("rope.scaling.attn_factor")) is not None:
        scaling["attention_factor"] = attn_factor
    return {**config, "rope_scaling": scaling,
            "original_max_position_embeddings": scaling["original_max_position_embeddings"]}
