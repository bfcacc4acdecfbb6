"""IBM Granite 4 (granitemoehybrid): Granite's multipliers over layers of Mamba-2 (`mamba`) or
attention (`self_attn`; rope or none, `position_embedding_type`), each followed by the MoE block
(`block_sparse_moe`, Granite's stacked experts, top-k softmax router) plus a dense shared MLP
(`shared_mlp`, its gate and up stacked in `input_linear`), or by the shared MLP alone when the
config has no experts."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from mlxcel.layers.decoder import DecoderArgs, LayerRecipe, MLPRecipe, RopeRecipe, split_fused
from mlxcel.layers.mamba2 import Mamba2Recipe
from mlxcel.layers.moe import MoE, MoESpec
from mlxcel.models import granite
from mlxcel.models._gguf import unpermute_qk
from mlxcel.models._hybrid import (fix_mamba2_weights, gguf_layer_kinds, gguf_rows, mamba2_gguf_names, mamba2_gguf_shape,
                                   per_layer_max, time_step_limit)
from mlxcel.models._moe import GGUF_MOE_NAMES, MoEArgs, MoEDecoderLM

if TYPE_CHECKING:
    from mlxcel.models._gguf import GGUFTensors

MAMBA_KINDS = ("mamba", "linear_attention")


@dataclass(frozen=True)
class ModelArgs(MoEArgs, granite.ModelArgs):
    num_local_experts: int = 0
    shared_intermediate_size: int = 0
    position_embedding_type: str | None = None
    mamba_n_heads: int = 128
    mamba_d_head: int = 64
    mamba_d_state: int = 256
    mamba_n_groups: int = 1
    mamba_d_conv: int = 4
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))

    MOE_ROUTER = "topk_softmax"
    MOE_BLOCK = "block_sparse_moe"

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = super().prepare(config)
        kinds = config.get("layer_types") or config.get("layers_block_type") or ["attention"] * config["num_hidden_layers"]
        return {**config, "layer_types": tuple(kinds), "time_step_limit": time_step_limit(config)}

    def is_mamba(self, layer_idx: int) -> bool:
        return self.layer_types is not None and self.layer_types[layer_idx] in MAMBA_KINDS

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.num_local_experts > 0

    def moe_spec(self) -> MoESpec:
        return replace(super().moe_spec(), shared_intermediate_size=self.shared_intermediate_size,
                       shared_name="shared_mlp")

    def layer_rope(self, layer_idx: int) -> RopeRecipe | None:
        return super().layer_rope(layer_idx) if self.position_embedding_type == "rope" else None

    def mamba_recipe(self) -> Mamba2Recipe:
        return Mamba2Recipe(self.mamba_n_heads, self.mamba_d_head, self.mamba_d_state, self.mamba_n_groups,
                            self.mamba_d_conv, self.mamba_chunk_size, self.rms_norm_eps,
                            proj_bias=self.mamba_proj_bias, conv_bias=self.mamba_conv_bias,
                            dt_limit=self.time_step_limit)

    def layer_recipe(self, layer_idx: int) -> LayerRecipe:
        recipe = super().layer_recipe(layer_idx)
        if not self.is_moe_layer(layer_idx):
            recipe = replace(recipe, mlp=MLPRecipe(self.shared_intermediate_size, self.hidden_act),
                             mlp_name="shared_mlp")
        else:
            recipe = replace(recipe, feed_forward=partial(MoE, self.moe_spec()))
        if self.is_mamba(layer_idx):
            recipe = replace(recipe, attention=self.mamba_recipe(), attention_name="mamba")
        return recipe


class Model(MoEDecoderLM):
    ARGS = ModelArgs
    MOE_LAYOUT = "granite"

    @classmethod
    def sanitize(cls, weights: dict[str, Any], args: DecoderArgs) -> dict[str, Any]:
        weights = dict(weights)
        shared = {k: weights.pop(k) for k in list(weights) if ".shared_mlp." in k}
        split_fused(shared, "input_linear", {"gate_proj": args.shared_intermediate_size,  # type: ignore[attr-defined]
                                             "up_proj": None})
        weights.update({k.replace(".output_linear.", ".down_proj."): v for k, v in shared.items()})
        if args.is_moe_layer(0):  # type: ignore[attr-defined]
            # The shared MLP sits beside the MoE in the checkpoint, inside our MoE block.
            weights = {k.replace(".shared_mlp.", ".block_sparse_moe.shared_mlp."): v for k, v in weights.items()}
        return super().sanitize(weights, args)


# ---- GGUF (issue 41): llama.cpp's granitehybrid ------------------------------------------------------

GGUF_LAYER_NAMES = {
    **{part: name.replace("mlp.", "block_sparse_moe.", 1) for part, name in GGUF_MOE_NAMES.items()},
    **mamba2_gguf_names("mamba"),
    "ffn_gate_shexp": "shared_mlp.gate_proj", "ffn_up_shexp": "shared_mlp.up_proj",
    "ffn_down_shexp": "shared_mlp.down_proj",
    # no experts: the converter writes the shared MLP as the layer's plain FFN
    "ffn_gate": "shared_mlp.gate_proj", "ffn_up": "shared_mlp.up_proj", "ffn_down": "shared_mlp.down_proj",
}


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    """Granite's multipliers, the Mamba-2 shape from `ssm.*`, each layer's kind from its tensors, no rope
    unless `rope.scaling.finetuned` (llama.cpp's granitehybrid ropes only Bamba and all-attention files)."""
    mamba = mamba2_gguf_shape(gguf)
    layers = config["num_hidden_layers"]
    experts = config.pop("num_experts", None) or 0
    shared = gguf.arch_value("expert_shared_feed_forward_length")
    out = {**granite.gguf_config(config, gguf),
           "layer_types": ["mamba" if k == "mamba" else "attention" for k in gguf_layer_kinds(gguf, layers)],
           "num_key_value_heads": per_layer_max(config.get("num_key_value_heads"))
           or gguf_rows(gguf, "attn_k.weight") // (config["hidden_size"] // config["num_attention_heads"]),
           "num_local_experts": experts, "shared_intermediate_size": shared or config.get("intermediate_size"),
           "position_embedding_type": "rope" if gguf.arch_value("rope.scaling.finetuned") else None,
           "mamba_n_heads": mamba["num_heads"], "mamba_d_head": mamba["head_dim"], "mamba_d_state": mamba["state_size"],
           "mamba_n_groups": mamba["n_groups"], "mamba_d_conv": mamba["conv_kernel"],
           "mamba_conv_bias": mamba["conv_bias"], "mamba_proj_bias": mamba["proj_bias"]}
    return out


def fix_gguf_weights(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    return fix_mamba2_weights(unpermute_qk(state, config), "mamba")  # q/k permuted as a LlamaModel's
