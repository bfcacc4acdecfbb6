"""Microsoft Phi-3 / Phi-3.5 / Phi-4-mini: the Llama recipe over fused `qkv_proj` and
`gate_up_proj` (split at load), partial rotary, longrope scaling and an optional window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlxcel.layers.decoder import DecoderArgs, DecoderLM, split_fused


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
