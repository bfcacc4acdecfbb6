"""Tencent Hunyuan dense (HunYuanDenseV1): the Llama recipe with per-head RMSNorm on q and k AFTER
rope (`query_layernorm` / `key_layernorm`), and NTK-alpha rope (`dynamic` with `alpha`: a larger
base, theta * alpha ** (d / (d - 2)))."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs, DecoderLM
from mlxcel.layers.rope import rope_type


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    rms_norm_eps: float = 1e-5

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = super().prepare(config)
        scaling = config.get("rope_scaling") or {}
        if rope_type(scaling) == "dynamic" and scaling.get("alpha"):
            dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
            config["rope_theta"] = config["rope_theta"] * float(scaling["alpha"]) ** (dim / (dim - 2))
            config["rope_scaling"] = None
        return config

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return replace(super().attention_recipe(layer_idx), qk_norm="head_after_rope",
                       qk_norm_names=("query_layernorm", "key_layernorm"))


class Model(DecoderLM):
    ARGS = ModelArgs


# llama.cpp's arch "hunyuan-dense" (loading/checkpoint.py's GGUF_ARCHITECTURES). Its converter
# writes the NTK-alpha base already scaled (rope.freq_base) with scaling type none.
GGUF_LAYER_NAMES = {"attn_q_norm": "self_attn.query_layernorm", "attn_k_norm": "self_attn.key_layernorm"}
