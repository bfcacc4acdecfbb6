"""gpt-oss: attention with biases and a learned sink logit per head, sliding and full layers
alternating, yarn rope, and an MoE in every layer: a biased router (top-k, then softmax over the
selected logits) and biased experts with the clamped SwiGLU; the checkpoint's experts are stacked
as x @ W with gate and up columns interleaved (`sanitize_moe`'s "gpt_oss" layout).

The released checkpoints store the experts in MXFP4 (`*_blocks`, `*_scales`, quant_method mxfp4):
loading/quantized.py reads them (kept as their codes on the CPU, dequantized elsewhere).

GGUF (llama.cpp's `gpt-oss`, issue 40): the converter splits gate_up into `ffn_gate_exps` / `ffn_up_exps`
(weights and biases, MXFP4 or float), keeps the sinks as `attn_sinks.weight` and the post-attention
norm as `post_attention_norm`; llama.cpp fixes the sliding pattern (every other layer, from layer 0) and
the SwiGLU's alpha 1.702 and limit 7.0 in code, and floors / ceils yarn's correction range, which
gpt-oss's own config (`truncate: false`) and transformers do not: the file loads as the HF checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs
from mlxcel.models._gguf import GGUFTensors, sliding_layer_types
from mlxcel.models._moe import GGUF_MOE_NAMES, MoEArgs, MoEDecoderLM

GGUF_LAYER_NAMES = {**GGUF_MOE_NAMES, "post_attention_norm": "post_attention_layernorm",
                    "attn_sinks": "self_attn.sinks"}
SWA_PERIOD = 2  # llama.cpp's default for gpt-oss: layers 0, 2, ... slide


@dataclass(frozen=True)
class ModelArgs(MoEArgs, DecoderArgs):
    rms_norm_eps: float = 1e-5
    attention_bias: bool = True
    head_dim: int | None = 64
    rope_theta: float = 150000.0

    MOE_ROUTER = "topk_softmax"
    MOE_OPTIONS = {"has_bias": True, "has_expert_bias": True, "activation": "swiglu_clamped"}

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return replace(super().attention_recipe(layer_idx), has_sinks=True)


class Model(MoEDecoderLM):
    ARGS = ModelArgs
    MOE_LAYOUT = "gpt_oss"

    @classmethod
    def sanitize(cls, weights: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        # GGUF names every tensor `.weight`; the sinks are a bare parameter here, as in transformers.
        renamed = {k.removesuffix(".weight") if k.endswith("self_attn.sinks.weight") else k: v for k, v in weights.items()}
        return super().sanitize(renamed, args)


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    scaling = config.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type") == "yarn":
        scaling = {**scaling, "truncate": False,
                   "beta_fast": gguf.arch_value("rope.scaling.yarn_beta_fast", 32.0),
                   "beta_slow": gguf.arch_value("rope.scaling.yarn_beta_slow", 1.0)}
    layer_types = sliding_layer_types(gguf, config["num_hidden_layers"], SWA_PERIOD)
    return {**config, "rope_scaling": scaling, "layer_types": layer_types}
