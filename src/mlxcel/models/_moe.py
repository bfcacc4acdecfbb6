"""What the mixture-of-experts families share: their MoE layers over layers/moe.py.

A family's `ModelArgs` puts `MoEArgs` before its dense base and names its router (`MOE_ROUTER`,
`MOE_OPTIONS`), the checkpoint's module name of the block (`MOE_BLOCK`) and which layers are MoE
(`is_moe_layer`); its `Model` is a `MoEDecoderLM` naming the checkpoint's expert layout."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import fields, replace
from functools import partial
from typing import Any, ClassVar

import torch

from mlxcel.layers.decoder import DecoderArgs, DecoderLM, LayerRecipe
from mlxcel.layers.moe import Layout, MoE, MoESpec, RouterKind, moe_spec_from_config, sanitize_moe
from mlxcel.models._gguf import GGUFTensors

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")

# llama.cpp's MoE tensors (after "blk.N.") -> the names `layers.moe.sanitize_moe` stacks from.
GGUF_MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# DeepSeek-style blocks (deepseek2, glm4moe): ungated shared experts and the router's selection bias
# (`exp_probs_b.bias`, which `MoEDecoderLM.sanitize` renames to transformers' `e_score_correction_bias`).
GGUF_SHARED_EXPERT_NAMES = {
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "exp_probs_b": "mlp.gate.e_score_correction",
}
_SELECTION_BIAS = ".gate.e_score_correction.bias"


class MoEArgs:
    """Mixin for a `DecoderArgs` subclass: layer i's dense MLP becomes an MoE where `is_moe_layer(i)`."""

    MOE_ROUTER: ClassVar[RouterKind] = "softmax"
    MOE_OPTIONS: ClassVar[Mapping[str, Any]] = {}  # MoESpec / RouterSpec fields the config does not say
    MOE_BLOCK: ClassVar[str] = "mlp"

    def is_moe_layer(self, layer_idx: int) -> bool:
        return True

    def moe_spec(self) -> MoESpec:
        return moe_spec_from_config(config_of(self), self.MOE_ROUTER, **self.MOE_OPTIONS)

    def layer_recipe(self, layer_idx: int) -> LayerRecipe:
        recipe = super().layer_recipe(layer_idx)  # type: ignore[misc]
        if not self.is_moe_layer(layer_idx):
            return recipe
        return replace(recipe, mlp=None, feed_forward=partial(MoE, self.moe_spec()), mlp_name=self.MOE_BLOCK)


class MoEDecoderLM(DecoderLM):
    """A decoder whose checkpoint stores its experts in `MOE_LAYOUT` (`layers.moe.sanitize_moe`)."""

    MOE_LAYOUT: ClassVar[Layout] = "per_expert"

    @classmethod
    def sanitize(cls, weights: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        # Layers past the last decoder layer are the MTP layers DeepSeek-V3 / GLM-4.5 carry: not served here.
        kept = {_unsuffixed(k): v for k, v in weights.items()
                if not (m := _LAYER.match(k)) or int(m.group(1)) < args.num_hidden_layers}
        return super().sanitize(sanitize_moe(kept, cls.MOE_LAYOUT), args)


def deepseek_moe_gguf_config(gguf: GGUFTensors) -> dict[str, Any]:
    """The HF settings of a DeepSeek-style MoE that llama.cpp keeps under its own `<arch>.` keys (deepseek2,
    glm4moe): leading dense layers, shared experts, the routed weights' scale and renormalisation, and the
    expert groups (llama.cpp reads the groups for every architecture)."""
    return {
        "first_k_dense_replace": gguf.arch_value("leading_dense_block_count", 0),
        "n_shared_experts": gguf.arch_value("expert_shared_count", 0),
        "routed_scaling_factor": gguf.arch_value("expert_weights_scale", 1.0),
        "norm_topk_prob": bool(gguf.arch_value("expert_weights_norm", False)),
        "n_group": gguf.arch_value("expert_group_count", 1),
        "topk_group": gguf.arch_value("expert_group_used_count", 1),
    }


def _unsuffixed(name: str) -> str:
    return name[:-len(_SELECTION_BIAS)] + ".gate.e_score_correction_bias" if name.endswith(_SELECTION_BIAS) else name


def config_of(args: Any) -> dict[str, Any]:
    """The family's config as a dict again (its fields over the keys it keeps in `extra`), for
    `layers.moe.moe_spec_from_config`, which reads the usual HF MoE keys."""
    return {**args.extra, **{f.name: getattr(args, f.name) for f in fields(args) if f.name != "extra"}}


def is_sparse_layer(args: DecoderArgs, layer_idx: int) -> bool:
    """Qwen2-MoE / Qwen3-MoE: every `decoder_sparse_step`-th layer is MoE, unless `mlp_only_layers` names it."""
    config = config_of(args)
    step, dense = config.get("decoder_sparse_step") or 1, config.get("mlp_only_layers") or ()
    num_experts = config.get("num_experts") or config.get("num_local_experts") or 0  # transformers 5 saves the latter
    return layer_idx not in dense and num_experts > 0 and (layer_idx + 1) % step == 0
