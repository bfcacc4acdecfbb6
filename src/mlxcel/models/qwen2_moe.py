"""Qwen1.5-MoE / Qwen2-MoE: the Qwen2 recipe whose sparse layers (every `decoder_sparse_step`-th, not
in `mlp_only_layers`) hold a softmax-routed MoE plus one shared expert gated by
sigmoid(`shared_expert_gate`(x))."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from mlxcel.layers.decoder import AttentionRecipe
from mlxcel.models import qwen2
from mlxcel.models._moe import GGUF_MOE_NAMES, MoEArgs, MoEDecoderLM, is_sparse_layer

if TYPE_CHECKING:
    from mlxcel.models._gguf import GGUFTensors

# llama.cpp's qwen2moe: the MoE stacks and the gated shared expert (ffn_*_shexp, its gate ffn_gate_inp_shexp).
GGUF_LAYER_NAMES = {
    **GGUF_MOE_NAMES,
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


@dataclass(frozen=True)
class ModelArgs(MoEArgs, qwen2.ModelArgs):
    qkv_bias: bool = True

    MOE_OPTIONS = {"shared_name": "shared_expert", "is_shared_gated": True}

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return replace(super().attention_recipe(layer_idx), q_bias=self.qkv_bias, kv_bias=self.qkv_bias)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return is_sparse_layer(self, layer_idx)


class Model(MoEDecoderLM):
    ARGS = ModelArgs


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    """The shared expert's width is llama.cpp's `expert_shared_feed_forward_length`; every layer is MoE."""
    shared = gguf.arch_value("expert_shared_feed_forward_length")
    return {**config, **({"shared_expert_intermediate_size": shared} if shared else {})}


def fix_gguf_weights(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The shared expert's gate is a [1, hidden] linear; the converter may store it as a vector."""
    for name in list(state):
        if name.endswith("shared_expert_gate.weight"):
            state[name] = state[name].reshape(1, -1)
    return state
