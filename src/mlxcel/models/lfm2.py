"""Liquid LFM2: layers of LFM2's gated short conv (`conv`, layers/short_conv.py) or GQA attention
(`self_attn`: per-head q/k RMSNorms `q_layernorm` / `k_layernorm`, output `out_proj`), each with
the SwiGLU feed-forward (`feed_forward`: w1, w3, w2); norms `operator_norm` and `ffn_norm`, the
final one `model.embedding_norm`. The feed-forward width follows `block_auto_adjust_ff_dim`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs, DecoderLM, LayerRecipe, MLPRecipe
from mlxcel.layers.short_conv import ShortConvRecipe
from mlxcel.models._hybrid import per_layer_max, rename_prefixes

if TYPE_CHECKING:
    from mlxcel.models._gguf import GGUFTensors


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    norm_eps: float = 1e-5
    conv_bias: bool = False
    conv_L_cache: int = 3
    block_auto_adjust_ff_dim: bool = True
    block_ffn_dim_multiplier: float | None = 1.0
    block_multiple_of: int = 256
    tie_word_embeddings: bool = True

    NORM_NAMES = {"attn_in": "operator_norm", "mlp_in": "ffn_norm"}

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = super().prepare(config)
        return {**config, "rms_norm_eps": config.get("norm_eps", cls.norm_eps)}

    @property
    def ffn_width(self) -> int:
        width = self.intermediate_size
        if self.block_auto_adjust_ff_dim:
            width = int(2 * width / 3)
            if self.block_ffn_dim_multiplier is not None:
                width = int(self.block_ffn_dim_multiplier * width)
                width = self.block_multiple_of * ((width + self.block_multiple_of - 1) // self.block_multiple_of)
        return width

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return replace(super().attention_recipe(layer_idx), qk_norm="head",
                       qk_norm_names=("q_layernorm", "k_layernorm"), o_name="out_proj")

    def mlp_recipe(self, layer_idx: int) -> MLPRecipe:
        return MLPRecipe(self.ffn_width, "silu", names=("w1", "w3", "w2"))

    def layer_recipe(self, layer_idx: int) -> LayerRecipe:
        recipe = replace(super().layer_recipe(layer_idx), mlp_name="feed_forward")
        if self.layer_types is not None and self.layer_types[layer_idx] == "conv":
            return replace(recipe, attention=ShortConvRecipe(self.conv_L_cache, self.conv_bias), attention_name="conv")
        return recipe


class Model(DecoderLM):
    ARGS = ModelArgs

    @classmethod
    def sanitize(cls, weights: dict[str, Any], args: DecoderArgs) -> dict[str, Any]:
        return super().sanitize(rename_prefixes(weights, {"model.embedding_norm.": "model.norm."}), args)


# ---- GGUF (issue 41): llama.cpp's lfm2 -------------------------------------------------------------------

GGUF_LAYER_NAMES = {
    "attn_norm": "operator_norm", "ffn_norm": "ffn_norm", "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm", "attn_output": "self_attn.out_proj",
    "shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj",
    "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
}
GGUF_GLOBAL_NAMES = {"token_embd_norm": "model.norm"}  # llama.cpp's name for LFM2's final `embedding_norm`


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    """The written feed-forward width is the adjusted one; the conv window is `shortconv.l_cache`; each
    layer's kind by its tensors."""
    layers = config["num_hidden_layers"]
    return {**config, "block_auto_adjust_ff_dim": False, "conv_L_cache": gguf.arch_value("shortconv.l_cache"),
            "norm_eps": config.get("rms_norm_eps", ModelArgs.norm_eps),
            "num_key_value_heads": per_layer_max(config.get("num_key_value_heads")),
            "conv_bias": "blk.0.shortconv.in_proj.bias" in gguf.tensors or any(
                n.endswith(".shortconv.in_proj.bias") for n in gguf.tensors),
            "layer_types": ["conv" if f"blk.{i}.shortconv.in_proj.weight" in gguf.tensors else "full_attention"
                            for i in range(layers)]}


def fix_gguf_weights(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The short conv's weight [C, K] as the converter squeezed it -> [C, 1, K]."""
    for name, value in list(state.items()):
        if name.endswith("conv.conv.weight") and value.dim() == 2:
            state[name] = value.unsqueeze(1)
    return state
