"""gpt-oss: attention with biases and a learned sink logit per head, sliding and full layers
alternating, yarn rope, and an MoE in every layer: a biased router (top-k, then softmax over the
selected logits) and biased experts with the clamped SwiGLU; the checkpoint's experts are stacked
as x @ W with gate and up columns interleaved (`sanitize_moe`'s "gpt_oss" layout).

NOTE: the released checkpoints store the experts in MXFP4 (`*_blocks`, `*_scales`); only
unquantized (bfloat16 / float32) expert tensors load here."""

from __future__ import annotations

from dataclasses import dataclass, replace

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs
from mlxcel.models._moe import MoEArgs, MoEDecoderLM


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
