"""Qwen3-Next (Qwen3-Next-80B-A3B): a hybrid of Gated DeltaNet layers (layers/gated_deltanet.py, per
`layer_types` or every layer but each `full_attention_interval`-th) and gated attention layers (q_proj
also gives a sigmoid output gate a head; per-head q/k norms; partial rotary), RMSNorms of the
(1 + w) form, MoE layers with a gated shared expert. The Qwen3.5 families (qwen3_5_text,
qwen3_5_moe_text) are this recipe with unfused linear-attention projections.

Its fused `in_proj_qkvz` / `in_proj_ba` (grouped per key head) are split at load into Qwen3.5's names.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from mlxcel.layers.decoder import FULL, AttentionRecipe, DecoderArgs, LayerRecipe, NormRecipe
from mlxcel.layers.gated_deltanet import GatedDeltaNetRecipe, split_qwen3_next_projections
from mlxcel.models._moe import GGUF_MOE_NAMES, MoEArgs, MoEDecoderLM, is_sparse_layer
from mlxcel.models._vision import LLAVA_TEXT_PREFIXES

if TYPE_CHECKING:
    from mlxcel.models._gguf import GGUFTensors

LINEAR = "linear_attention"

# The MTP head's weights (fc, norms, one full-attention decoder layer): no part of the forward; the
# speculative path reads them (F10: engine/spec/mtp.py, layers/mtp.py).
MTP_HEAD_PREFIXES = ("mtp.", "model.mtp.")
MTP_LAYERS_PREFIX = MTP_HEAD_PREFIXES[0]  # F10's mark of a family whose MTP layers draft
# The Qwen3.5 vision-language checkpoints: their text model under LLAVA_TEXT_PREFIXES; vision tower and MTP head dropped.
_DROPPED_PREFIXES = ("model.visual.", "visual.", *MTP_HEAD_PREFIXES)


@dataclass(frozen=True)
class HybridArgs(DecoderArgs):
    """What Qwen3-Next and Qwen3.5 share: the layer pattern, the linear-attention shape, the norms."""

    head_dim: int | None = 256
    partial_rotary_factor: float = 0.25
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4
    linear_v_head_order: str = "grouped"  # "tiled" in llama.cpp's Qwen3.5 GGUFs (layers/gated_deltanet.py)

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        rope = config.get("rope_parameters") or {}
        factor = config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or cls.partial_rotary_factor
        if not config.get("layer_types"):
            interval = config.get("full_attention_interval") or cls.full_attention_interval
            config = {**config, "layer_types": [FULL if (i + 1) % interval == 0 else LINEAR
                                                for i in range(config["num_hidden_layers"])]}
        return super().prepare({**config, "partial_rotary_factor": factor})

    def is_linear_layer(self, layer_idx: int) -> bool:
        return self.layer_types is not None and self.layer_types[layer_idx] == LINEAR

    def norm_recipe(self) -> NormRecipe:
        return NormRecipe("rms", self.rms_norm_eps, offset=1.0)

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return replace(super().attention_recipe(layer_idx), qk_norm="head", output_gate=True)

    def linear_recipe(self) -> GatedDeltaNetRecipe:
        return GatedDeltaNetRecipe(self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
                                   self.linear_value_head_dim, self.linear_conv_kernel_dim, self.rms_norm_eps,
                                   v_head_order=self.linear_v_head_order)

    def layer_recipe(self, layer_idx: int) -> LayerRecipe:
        recipe = super().layer_recipe(layer_idx)
        if not self.is_linear_layer(layer_idx):
            return recipe
        return replace(recipe, attention=self.linear_recipe(), attention_name="linear_attn")


@dataclass(frozen=True)
class ModelArgs(MoEArgs, HybridArgs):
    MOE_OPTIONS = {"shared_name": "shared_expert", "is_shared_gated": True}

    def is_moe_layer(self, layer_idx: int) -> bool:
        return is_sparse_layer(self, layer_idx)


class HybridLM(MoEDecoderLM):
    """The Qwen3-Next / Qwen3.5 model: text weights of a multimodal checkpoint kept, the MTP head left to
    the drafter."""

    ARGS = ModelArgs

    @classmethod
    def sanitize(cls, weights: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        kept = {text: value for name, value in weights.items() if (text := _text_name(name)) is not None}
        assert isinstance(args, HybridArgs)
        split_qwen3_next_projections(kept, args.linear_recipe())
        return super().sanitize(kept, args)


class Model(HybridLM):
    ARGS = ModelArgs


def _text_name(name: str) -> str | None:
    if name.startswith(_DROPPED_PREFIXES):
        return None
    for prefix, replacement in LLAVA_TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name


# ---- GGUF (issue 41): llama.cpp's qwen3next / qwen35 / qwen35moe, as convert_hf_to_gguf.py writes them ----

GGUF_LAYER_NAMES = {
    **GGUF_MOE_NAMES,
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",  # Qwen3-Next's in_proj_qkvz split by the converter: q, k, v ...
    "attn_gate": "linear_attn.in_proj_z",  # ... and z
    "ssm_ba": "linear_attn.in_proj_ba",  # Qwen3-Next's, kept fused (split at load as the HF one)
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_a": "linear_attn.A_log",  # stored as -exp(A_log)
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d": "linear_attn.conv1d",  # [C, K], squeezed
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
_TILED_ARCHES = ("qwen3_5_text", "qwen3_5_moe_text")  # the converter's _LinearAttentionVReorderBase


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    """The linear-attention shape from llama.cpp's `ssm.*` keys; which layers are linear from the tensors the
    file holds (its `full_attention_interval` alone cannot say `layer_types`); Qwen3.5's value heads in
    the converter's tiled order; the shared expert's width; top-k renormalised (llama.cpp's qwen3next
    always renormalises)."""
    v_heads, inner = gguf.arch_value("ssm.time_step_rank"), gguf.arch_value("ssm.inner_size")
    layers = config["num_hidden_layers"] - (gguf.arch_value("nextn_predict_layers") or 0)
    out = {
        "norm_topk_prob": True, **config, "num_hidden_layers": layers,
        "linear_conv_kernel_dim": gguf.arch_value("ssm.conv_kernel"),
        "linear_key_head_dim": gguf.arch_value("ssm.state_size"),
        "linear_num_key_heads": gguf.arch_value("ssm.group_count"),
        "linear_num_value_heads": v_heads, "linear_value_head_dim": inner // v_heads,
        "layer_types": [LINEAR if f"blk.{i}.ssm_a" in gguf.tensors else FULL for i in range(layers)],
        "linear_v_head_order": "tiled" if config["model_type"] in _TILED_ARCHES else "grouped",
    }
    if shared := gguf.arch_value("expert_shared_feed_forward_length"):
        out["shared_expert_intermediate_size"] = shared
    return out


def fix_gguf_weights(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Undo the converter's changes: A_log from -exp(A_log), the conv's squeezed channel axis, every
    (1 + w) RMSNorm stored as 1 + w (the gated norm of the linear attention is plain), the shared expert's
    gate as a vector."""
    for name, value in list(state.items()):
        if name.endswith("linear_attn.A_log"):
            state[name] = torch.log(-value)
        elif name.endswith("linear_attn.conv1d.weight") and value.dim() == 2:
            state[name] = value.unsqueeze(1)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            state[name] = value - 1.0
        elif name.endswith("shared_expert_gate.weight"):
            state[name] = value.reshape(1, -1)
    return state
