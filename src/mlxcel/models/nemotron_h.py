"""NVIDIA Nemotron-H: one job a layer, after `hybrid_override_pattern` (or transformers'
`layers_block_type`): `M` Mamba-2, `*` attention without rope, `-` a plain relu^2 MLP, `E` an MoE
(Nemotron 3 Nano 30B-A3B: layers/moe.py with a sigmoid router, its `e_score_correction_bias` and grouped
top-k, ungated relu^2 experts and one ungated shared expert, an optional latent projection around the
experts); each a pre-norm residual block (layers/hybrid.py). The checkpoint's `backbone.embeddings` and
`backbone.norm_f` are read as `model.embed_tokens` and `model.norm`; its MTP head (`mtp.`) is not served."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs, MLPRecipe, NormRecipe
from mlxcel.layers.hybrid import BlockRecipe
from mlxcel.layers.mamba2 import Mamba2Recipe
from mlxcel.layers.moe import MoE, MoESpec, RouterSpec
from mlxcel.models._hybrid import (fix_mamba2_weights, gguf_layer_kinds, gguf_rows, mamba2_gguf_names, mamba2_gguf_shape,
                                   per_layer_max, rename_prefixes, time_step_limit)
from mlxcel.models._moe import MoEDecoderLM

if TYPE_CHECKING:
    from mlxcel.models._gguf import GGUFTensors

# hybrid_override_pattern's letters -> transformers' layer kinds
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
MAMBA, ATTENTION, MLP_LAYER, MOE_LAYER = "linear_attention", "full_attention", "mlp", "moe"
# llama.cpp's converter spells transformers' list form its own way
_KIND_ALIASES = {"mamba": MAMBA, "attention": ATTENTION}
# The checkpoint's names (NVIDIA's `backbone.`, or transformers' `model.`) -> ours
_GLOBAL_NAMES = {"backbone.embeddings.": "model.embed_tokens.", "backbone.norm_f.": "model.norm.",
                 "backbone.": "model.", "model.embeddings.": "model.embed_tokens.", "model.norm_f.": "model.norm."}


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    layers_block_type: tuple[str, ...] = ()
    layer_norm_epsilon: float = 1e-5
    mlp_hidden_act: str = "relu2"
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    mamba_proj_bias: bool = False
    use_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    n_routed_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = super().prepare(config)
        kinds = config.get("layers_block_type") or [PATTERN.get(c, c) for c in config.get("hybrid_override_pattern", "")]
        kinds = [_KIND_ALIASES.get(k, k) for k in kinds]
        unknown = sorted({k for k in kinds if k not in (MAMBA, ATTENTION, MLP_LAYER, MOE_LAYER)})
        if unknown:
            raise ValueError(f"Nemotron-H layers of kind {', '.join(unknown)} are not supported")
        return {**config, "layers_block_type": tuple(kinds), "num_hidden_layers": len(kinds),
                "time_step_limit": time_step_limit(config)}

    def norm_recipe(self) -> NormRecipe:
        return NormRecipe("rms", self.layer_norm_epsilon)

    def mamba_recipe(self) -> Mamba2Recipe:
        return Mamba2Recipe(self.mamba_num_heads, self.mamba_head_dim, self.ssm_state_size, self.n_groups,
                            self.conv_kernel, self.chunk_size, self.layer_norm_epsilon,
                            proj_bias=self.use_bias, conv_bias=self.use_conv_bias, dt_limit=self.time_step_limit)

    def moe_spec(self) -> MoESpec:
        router = RouterSpec("sigmoid_grouped", self.n_routed_experts, self.num_experts_per_tok,
                            normalize=self.norm_topk_prob, num_groups=self.n_group, topk_groups=self.topk_group,
                            scaling=self.routed_scaling_factor)
        return MoESpec(router, self.hidden_size, self.moe_intermediate_size, activation=self.mlp_hidden_act,
                       shared_intermediate_size=self.moe_shared_expert_intermediate_size, gated=False,
                       latent_size=self.moe_latent_size or 0)

    def layer_recipe(self, layer_idx: int) -> BlockRecipe:  # type: ignore[override]
        kind, norm = self.layers_block_type[layer_idx], self.norm_recipe()
        if kind == MAMBA:
            return BlockRecipe(norm, attention=self.mamba_recipe())
        if kind == ATTENTION:
            return BlockRecipe(norm, attention=AttentionRecipe(
                self.num_attention_heads, self.kv_heads, self.dim_per_head, self.dim_per_head**-0.5, None,
                q_bias=self.attention_bias, kv_bias=self.attention_bias, o_bias=self.attention_bias))
        if kind == MOE_LAYER:
            return BlockRecipe(norm, feed_forward=partial(MoE, self.moe_spec()))
        return BlockRecipe(norm, mlp=MLPRecipe(self.intermediate_size, self.mlp_hidden_act, gated=False,
                                               bias=self.mlp_bias, names=("up_proj", "down_proj")))


class Model(MoEDecoderLM):
    ARGS: ClassVar[type[DecoderArgs]] = ModelArgs

    @classmethod
    def sanitize(cls, weights: dict[str, Any], args: DecoderArgs) -> dict[str, Any]:
        weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
        return super().sanitize(rename_prefixes(weights, _GLOBAL_NAMES), args)


# ---- GGUF (issue 41): llama.cpp's nemotron_h and nemotron_h_moe -------------------------------------

GGUF_LAYER_NAMES = {
    "attn_norm": "norm", **mamba2_gguf_names("mixer"),
    "attn_q": "mixer.q_proj", "attn_k": "mixer.k_proj", "attn_v": "mixer.v_proj", "attn_output": "mixer.o_proj",
    "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj",
    "ffn_gate_inp": "mixer.gate", "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "ffn_up_exps": "mixer.experts.up_proj", "ffn_down_exps": "mixer.experts.down_proj",
    "ffn_up_shexp": "mixer.shared_experts.up_proj", "ffn_down_shexp": "mixer.shared_experts.down_proj",
    "ffn_latent_down": "mixer.fc1_latent_proj", "ffn_latent_up": "mixer.fc2_latent_proj",
}
_GGUF_KINDS = {"mamba": MAMBA, "attention": ATTENTION, "moe": MOE_LAYER, "mlp": MLP_LAYER}


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    """Each layer's job from the tensors it holds (the file has no pattern), the Mamba-2 shape from `ssm.*`,
    the per-layer arrays' one width, the MoE router from the `expert_*` keys."""
    layers = config["num_hidden_layers"] - (gguf.arch_value("nextn_predict_layers") or 0)
    mamba = mamba2_gguf_shape(gguf)
    eps = gguf.arch_value("attention.layer_norm_epsilon") or gguf.arch_value("attention.layer_norm_rms_epsilon")
    out = {**config, "layers_block_type": [_GGUF_KINDS[k] for k in gguf_layer_kinds(gguf, layers)],
           "num_hidden_layers": layers, "layer_norm_epsilon": eps,
           # the shapes where the arrays say 0 (the converter's, on a config transformers 5 saved)
           "num_key_value_heads": per_layer_max(gguf.arch_value("attention.head_count_kv"))
           or gguf_rows(gguf, "attn_k.weight") // (config.get("head_dim") or 1),
           "num_attention_heads": per_layer_max(gguf.arch_value("attention.head_count")),
           "intermediate_size": gguf_rows(gguf, "ffn_up.weight") or per_layer_max(gguf.arch_value("feed_forward_length")),
           "mamba_num_heads": mamba["num_heads"], "mamba_head_dim": mamba["head_dim"],
           "ssm_state_size": mamba["state_size"], "n_groups": mamba["n_groups"], "conv_kernel": mamba["conv_kernel"],
           "use_conv_bias": mamba["conv_bias"], "use_bias": mamba["proj_bias"],
           "attention_bias": any(n.endswith(".attn_q.bias") for n in gguf.tensors),
           "mlp_bias": any(n.endswith((".ffn_up.bias", ".ffn_up_shexp.bias")) for n in gguf.tensors)}
    if MOE_LAYER in out["layers_block_type"]:
        experts = gguf.arch_value("expert_count")
        out.update(n_routed_experts=experts, num_experts_per_tok=gguf.arch_value("expert_used_count"),
                   moe_intermediate_size=gguf.arch_value("expert_feed_forward_length"),
                   moe_shared_expert_intermediate_size=gguf.arch_value("expert_shared_feed_forward_length") or 0,
                   norm_topk_prob=bool(gguf.arch_value("expert_weights_norm", False)),
                   routed_scaling_factor=gguf.arch_value("expert_weights_scale", 1.0),
                   n_group=gguf.arch_value("expert_group_count") or 1,
                   topk_group=gguf.arch_value("expert_group_used_count") or 1,
                   moe_latent_size=gguf.arch_value("moe_latent_size"))
    return out


def fix_gguf_weights(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    return fix_mamba2_weights(state, "mixer")
