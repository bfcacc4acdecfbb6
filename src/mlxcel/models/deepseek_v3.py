"""DeepSeek-V3 / R1 (and Kimi K2, the same shape): multi-head latent attention (layers/mla.py, the
latent KV cache with absorbed projections), dense MLPs in the first `first_k_dense_replace`
layers and sigmoid-routed experts with shared experts in the rest (layers/moe.py).

GGUF (llama.cpp's `deepseek2`, issue 40: DeepSeek-V2, V3 and Kimi K2 alike): the converter writes MLA as MQA
(`head_count_kv` 1, `key_length` kv_lora_rank + rope dims, `value_length` kv_lora_rank; the real head sizes
as `key_length_mla` / `value_length_mla`, absent from older files, whose `key_length` / `value_length` are
those), the latent widths as `attention.q_lora_rank` / `kv_lora_rank` (no q_lora_rank: `attn_q`), and
kv_b either whole (`attn_kv_b`, older files) or split per head into `attn_k_b` [H, kv_lora_rank, nope]
(transposed) and `attn_v_b` [H, v, kv_lora_rank], joined again here. The router is `expert_gating_func`:
sigmoid (2) is V3's (as is a file with the selection bias `exp_probs_b`), softmax (1, or absent in V2
files) loads as deepseek_v2; groups are
`expert_group_count` / `expert_group_used_count`; yarn's mscale as `rope.scaling.yarn_log_multiplier`
(0.1 mscale_all_dim; every release has mscale equal to it)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from mlxcel.layers.decoder import DecoderArgs, RopeRecipe, combined
from mlxcel.layers.mla import MLARecipe
from mlxcel.layers.rope import rope_type
from mlxcel.models._gguf import GGUFTensors
from mlxcel.models._moe import (
    GGUF_MOE_NAMES, GGUF_SHARED_EXPERT_NAMES, MoEArgs, MoEDecoderLM, deepseek_moe_gguf_config,
)

GGUF_LAYER_NAMES = {
    **GGUF_MOE_NAMES, **GGUF_SHARED_EXPERT_NAMES,
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj", "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj",
}
SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
_K_B = re.compile(r"^(.*\.self_attn\.)k_b_proj\.weight$")


@dataclass(frozen=True)
class ModelArgs(MoEArgs, DecoderArgs):
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    first_k_dense_replace: int = 3
    n_routed_experts: int | None = 256
    moe_intermediate_size: int = 2048

    MOE_ROUTER = "sigmoid_grouped"

    @property
    def kv_heads(self) -> int:
        return 1  # the cache holds one latent "head" a token

    @property
    def dim_per_head(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kv_values_are_keys(self) -> bool:
        return True  # the latent is attended as key and as value: the cache stores it once

    def softmax_scale(self) -> float:
        """qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) squared (as DeepSeek scales it)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        scaling = self.rope_scaling or {}
        if rope_type(scaling) != "default" and scaling.get("mscale_all_dim"):
            mscale = 0.1 * float(scaling["mscale_all_dim"]) * math.log(float(scaling["factor"])) + 1.0
            scale *= mscale * mscale
        return scale

    def layer_rope(self, layer_idx: int) -> RopeRecipe:
        return RopeRecipe.of(self.rope_theta, self.rope_scaling, self.qk_rope_head_dim,
                             interleaved=self.rope_interleave)

    def attention_recipe(self, layer_idx: int) -> MLARecipe:  # type: ignore[override]
        return MLARecipe(self.num_attention_heads, self.q_lora_rank, self.kv_lora_rank, self.qk_nope_head_dim,
                         self.qk_rope_head_dim, self.v_head_dim, self.softmax_scale(), self.layer_rope(layer_idx),
                         bias=self.attention_bias)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return bool(self.n_routed_experts) and layer_idx >= self.first_k_dense_replace


class Model(MoEDecoderLM):
    ARGS = ModelArgs

    @classmethod
    def sanitize(cls, weights: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        return super().sanitize(join_kv_b(weights), args)


def join_kv_b(weights: dict[str, Any]) -> dict[str, Any]:
    """GGUF's per-head k_b [H, kv_lora_rank, nope] and v_b [H, v, kv_lora_rank] as transformers' kv_b_proj
    [H * (nope + v), kv_lora_rank] (each head's nope rows, then its v rows)."""
    kept = dict(weights)
    for name in [n for n in weights if _K_B.match(n)]:
        prefix = name[:-len("k_b_proj.weight")]
        keys = [name, f"{prefix}v_b_proj.weight"]
        kept[f"{prefix}kv_b_proj.weight"] = combined(weights, keys, lambda ts: torch.cat(
            (ts[0].transpose(1, 2), ts[1]), dim=1).reshape(-1, ts[1].shape[-1]))
        del kept[keys[0]], kept[keys[1]]
    return kept


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    rope = int(gguf.arch_value("rope.dimension_count"))
    mla_keys = gguf.arch_value("attention.key_length_mla") is not None
    key_length = gguf.arch_value("attention.key_length_mla" if mla_keys else "attention.key_length")
    value_length = gguf.arch_value("attention.value_length_mla" if mla_keys else "attention.value_length")
    num_experts = config.get("num_experts")
    # V3's selection bias marks it too (a config without `scoring_func`, as transformers 5 saves it, writes no gating)
    is_sigmoid = (gguf.arch_value("expert_gating_func") == SIGMOID_GATING
                  or any(name.endswith(".exp_probs_b.bias") for name in gguf.tensors))
    moe = deepseek_moe_gguf_config(gguf)
    out = {k: v for k, v in config.items() if k not in ("head_dim", "partial_rotary_factor")}
    out.update(moe, model_type="deepseek_v3" if is_sigmoid else "deepseek_v2",
               num_key_value_heads=config["num_attention_heads"], q_lora_rank=gguf.arch_value("attention.q_lora_rank"),
               kv_lora_rank=gguf.arch_value("attention.kv_lora_rank"), qk_rope_head_dim=rope,
               qk_nope_head_dim=int(key_length) - rope, v_head_dim=int(value_length), n_routed_experts=num_experts,
               topk_method="group_limited_greedy" if moe["n_group"] > 1 else "greedy",
               rope_scaling=_yarn(config.get("rope_scaling"), gguf))
    return out


def _yarn(scaling: dict[str, Any] | None, gguf: GGUFTensors) -> dict[str, Any] | None:
    log_mul = gguf.arch_value("rope.scaling.yarn_log_multiplier")
    if scaling is None or scaling.get("rope_type") != "yarn" or log_mul is None:
        return scaling
    mscale = float(log_mul) / 0.1
    return {**scaling, "mscale": mscale, "mscale_all_dim": mscale,
            "beta_fast": gguf.arch_value("rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": gguf.arch_value("rope.scaling.yarn_beta_slow", 1.0)}
