"""A tiny transformers model written as a GGUF exactly as llama.cpp's convert_hf_to_gguf.py writes
its architecture (issue 40): the architecture name, the `<arch>.` metadata keys, tensor names and
the layout changes (Llama's q/k row permutation, Gemma's (1 + w) norms, rope factor tensors).
Each entry was checked against the converter's own output (test_gguf_families.py's converter test).
No tokenizer is written: the loader needs none, and the converter's is compared apart."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .harness import _split_expert_stacks, llama3_freq_factors


@dataclass(frozen=True)
class Layout:
    """How the converter writes one HF architecture."""

    arch: str
    names: dict[str, str] = field(default_factory=dict)  # HF per-layer part -> GGUF part, beyond LLAMA_NAMES
    permute_qk: bool = False  # LlamaModel subclasses (llama, mistral, smollm3, granite)
    norm_plus_one: bool = False  # Gemma
    vocab_size_key: bool = False
    rope_dims: bool = False  # writes rope.dimension_count
    extra: Callable[[Any, dict[str, Any]], None] | None = None  # family metadata
    drop_head: bool = False  # gemma2: lm_head.weight skipped
    # the converter's own tensor changes (issue 40: gpt-oss's expert split, MLA's kv_b split), on the HF state
    # dict before naming: HF names in, names `names` maps out
    state: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]] | None = None


LLAMA_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
# Issue 40: the MoE tensors (transformers 5's stacked experts split as the converter writes them).
MOE_NAMES = {"mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
             "mlp.experts.down_proj": "ffn_down_exps"}
GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
                # Gemma 4's per-layer inputs
                "model.embed_tokens_per_layer": "per_layer_token_embd",
                "model.per_layer_model_projection": "per_layer_model_proj",
                "model.per_layer_projection_norm": "per_layer_proj_norm"}
GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}
POST_NORM_NAMES = {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def _window_pattern(cfg: Any, meta: dict[str, Any]) -> None:
    if getattr(cfg, "sliding_window", None) is not None:
        meta["attention.sliding_window"] = cfg.sliding_window
        if getattr(cfg, "layer_types", None):
            meta["attention.sliding_window_pattern"] = [t == "sliding_attention" for t in cfg.layer_types]


def _gemma2(cfg: Any, meta: dict[str, Any]) -> None:
    meta.pop("rope.freq_base")
    meta.update({"attn_logit_softcapping": cfg.attn_logit_softcapping,
                 "final_logit_softcapping": cfg.final_logit_softcapping, "attention.sliding_window": cfg.sliding_window})


def _gemma3(cfg: Any, meta: dict[str, Any]) -> None:
    meta["attention.sliding_window"] = cfg.sliding_window
    if softcap := cfg.to_dict().get("final_logit_softcapping"):
        meta["final_logit_softcapping"] = softcap
    if (local := cfg.rope_parameters.get("sliding_attention", {}).get("rope_theta")) is not None:
        meta["rope.freq_base_swa"] = local


GEMMA4_NAMES = {**GEMMA_NAMES, "layer_scalar": "layer_output_scale", "per_layer_input_gate": "inp_gate",
                "per_layer_projection": "proj", "post_per_layer_input_norm": "post_norm"}


def _gemma4(cfg: Any, meta: dict[str, Any]) -> None:
    """conversion/gemma.py's Gemma4Model.set_gguf_parameters (over Gemma 3's)."""
    _gemma3(cfg, meta)
    raw = cfg.to_dict()  # (per-layer attributes are not read from a heterogeneous config itself)
    types = raw["layer_types"]
    full = raw["per_layer_config"][str(types.index("full_attention"))]
    head_dim, kv_heads = raw["head_dim"], raw["num_key_value_heads"]
    meta.update({"attention.shared_kv_layers": raw["num_kv_shared_layers"],
                 "embedding_length_per_layer_input": raw["hidden_size_per_layer_input"] or 0,
                 "attention.sliding_window_pattern": [t == "sliding_attention" for t in types],
                 "attention.key_length": full["head_dim"], "attention.value_length": full["head_dim"],
                 "attention.key_length_swa": head_dim, "attention.value_length_swa": head_dim,
                 "rope.dimension_count": full["head_dim"], "rope.dimension_count_swa": head_dim})
    first_shared = raw["num_hidden_layers"] - raw["num_kv_shared_layers"]
    if raw["use_double_wide_mlp"]:
        meta["feed_forward_length"] = [raw["intermediate_size"] * (1 if i < first_shared else 2)
                                       for i in range(raw["num_hidden_layers"])]
    if full.get("num_key_value_heads", kv_heads) != kv_heads:
        meta["attention.head_count_kv"] = [kv_heads if t == "sliding_attention" else full["num_key_value_heads"]
                                           for t in types]


def gemma4_rope_freqs(cfg: Any) -> np.ndarray:
    """`rope_freqs` of the global layers: 1 where an angle turns, 1e30 where it does not (proportional rope)."""
    raw = cfg.to_dict()
    head_dim = raw["per_layer_config"][str(raw["layer_types"].index("full_attention"))]["head_dim"]
    turned = int(head_dim * cfg.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    return np.array([1.0] * turned + [1e30] * (head_dim // 2 - turned), dtype=np.float32)


def _cohere2(cfg: Any, meta: dict[str, Any]) -> None:
    meta.update({"logit_scale": cfg.logit_scale, "attention.sliding_window": cfg.sliding_window})


def _granite(cfg: Any, meta: dict[str, Any]) -> None:
    meta.update({"attention.scale": cfg.attention_multiplier, "embedding_scale": cfg.embedding_multiplier,
                 "residual_scale": cfg.residual_multiplier, "logit_scale": cfg.logits_scaling})


def _hunyuan(cfg: Any, meta: dict[str, Any]) -> None:
    rope = cfg.rope_parameters
    dim = cfg.head_dim
    meta.update({"rope.freq_base": rope["rope_theta"] * rope["alpha"] ** (dim / (dim - 2)),
                 "rope.scaling.type": "none", "rope.scaling.factor": 1.0,
                 "rope.scaling.original_context_length": 256 * 1024, "context_length": 256 * 1024})


def _phi3(cfg: Any, meta: dict[str, Any]) -> None:
    meta["rope.scaling.original_context_length"] = cfg.rope_parameters["original_max_position_embeddings"]
    meta["attention.sliding_window"] = cfg.sliding_window or 0
    scale = cfg.max_position_embeddings / cfg.rope_parameters["original_max_position_embeddings"]
    if cfg.rope_parameters.get("long_factor"):
        orig = cfg.rope_parameters["original_max_position_embeddings"]
        meta["rope.scaling.attn_factor"] = float(np.sqrt(1 + np.log(scale) / np.log(orig))) if scale > 1 else 1.0


def _experts(cfg: Any, meta: dict[str, Any]) -> None:
    meta.update({"expert_count": getattr(cfg, "num_local_experts", None) or cfg.num_experts,
                 "expert_used_count": cfg.num_experts_per_tok})


def _qwen2_moe(cfg: Any, meta: dict[str, Any]) -> None:
    _experts(cfg, meta)
    meta.update({"expert_feed_forward_length": cfg.moe_intermediate_size,
                 "expert_shared_feed_forward_length": cfg.shared_expert_intermediate_size})


def _granitemoe(cfg: Any, meta: dict[str, Any]) -> None:
    _granite(cfg, meta)
    _experts(cfg, meta)


# Transformers' granitemoe keeps its router as `router`, its experts under block_sparse_moe.
GRANITE_MOE_NAMES = {"block_sparse_moe.router": "ffn_gate_inp",
                     **{k.replace("mlp.", "block_sparse_moe."): v for k, v in MOE_NAMES.items() if k != "mlp.gate"}}


def _gpt_oss(cfg: Any, meta: dict[str, Any]) -> None:
    _experts(cfg, meta)
    rope = cfg.rope_parameters
    meta.update({"attention.sliding_window": cfg.sliding_window, "expert_feed_forward_length": cfg.intermediate_size,
                 "rope.scaling.yarn_beta_fast": rope["beta_fast"], "rope.scaling.yarn_beta_slow": rope["beta_slow"]})


def gpt_oss_state(state: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """GptOssModel.modify_tensors on float experts: gate_up [E, H, 2I] transposed and split by its
    interleaved rows (gate 0::2, up 1::2), biases likewise, down transposed; the sinks named `.weight`."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        stem = name.rsplit(".", 1)[0]
        if name.endswith("self_attn.sinks"):
            out[f"{name}.weight"] = t
        elif name.endswith("experts.gate_up_proj"):
            rows = t.transpose(1, 2)
            out[f"{stem}.gate_proj.weight"], out[f"{stem}.up_proj.weight"] = rows[:, 0::2], rows[:, 1::2]
        elif name.endswith("experts.gate_up_proj_bias"):
            out[f"{stem}.gate_proj.bias"], out[f"{stem}.up_proj.bias"] = t[..., 0::2], t[..., 1::2]
        elif name.endswith("experts.down_proj"):
            out[f"{name}.weight"] = t.transpose(1, 2)
        elif name.endswith("experts.down_proj_bias"):
            out[f"{stem}.down_proj.bias"] = t
        else:
            out[name] = t
    return out


def _deepseek_moe(cfg: Any, meta: dict[str, Any]) -> None:
    """The MoE keys Glm4MoeModel / DeepseekV2Model write (groups and experts through the base class)."""
    meta.update({"expert_count": cfg.n_routed_experts, "expert_used_count": cfg.num_experts_per_tok,
                 "expert_group_count": cfg.n_group, "expert_group_used_count": cfg.topk_group,
                 "expert_feed_forward_length": cfg.moe_intermediate_size, "expert_shared_count": cfg.n_shared_experts,
                 "leading_dense_block_count": cfg.first_k_dense_replace,
                 "expert_weights_scale": cfg.routed_scaling_factor})
    if cfg.norm_topk_prob:
        meta["expert_weights_norm"] = True


def _glm4_moe(cfg: Any, meta: dict[str, Any]) -> None:
    _deepseek_moe(cfg, meta)
    meta.update({"block_count": cfg.num_hidden_layers + cfg.num_nextn_predict_layers,
                 "nextn_predict_layers": cfg.num_nextn_predict_layers, "expert_gating_func": 2,
                 "expert_weights_norm": bool(cfg.norm_topk_prob)})


def _deepseek2(cfg: Any, meta: dict[str, Any]) -> None:
    _deepseek_moe(cfg, meta)
    rope = cfg.qk_rope_head_dim
    meta.update({"attention.head_count_kv": 1, "attention.key_length": cfg.kv_lora_rank + rope,
                 "attention.value_length": cfg.kv_lora_rank, "attention.kv_lora_rank": cfg.kv_lora_rank,
                 "attention.key_length_mla": cfg.qk_nope_head_dim + rope, "attention.value_length_mla": cfg.v_head_dim,
                 "rope.dimension_count": rope, "vocab_size": cfg.vocab_size})
    if cfg.q_lora_rank is not None:
        meta["attention.q_lora_rank"] = cfg.q_lora_rank


def _deepseek2_whole_kv_b(cfg: Any, meta: dict[str, Any]) -> None:
    """Files from converters before the k_b / v_b split: kv_b whole, the real head sizes as key_length /
    value_length, no *_mla keys (llama.cpp loads both forms)."""
    _deepseek2(cfg, meta)
    for key in ("attention.key_length_mla", "attention.value_length_mla"):
        del meta[key]
    meta.update({"attention.key_length": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                 "attention.value_length": cfg.v_head_dim, "attention.head_count_kv": cfg.num_key_value_heads})


def mla_state(state: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """DeepseekV2Model.modify_tensors: kv_b [H * (nope + v), kv_lora] split per head into k_b (transposed:
    [H, kv_lora, nope]) and v_b [H, v, kv_lora]; the selection bias as `e_score_correction.bias`."""
    out = dict(selection_bias_state(state, cfg))
    for name in [n for n in out if n.endswith("kv_b_proj.weight")]:
        kv_b = out.pop(name).view(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
        k_b, v_b = kv_b.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)
        out[name.replace("kv_b_proj", "k_b_proj")] = k_b.transpose(1, 2)
        out[name.replace("kv_b_proj", "v_b_proj")] = v_b
    return out


def selection_bias_state(state: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    return {name.replace("e_score_correction_bias", "e_score_correction.bias"): t for name, t in state.items()}


DEEPSEEK_MOE_NAMES = {**MOE_NAMES, "mlp.gate.e_score_correction": "exp_probs_b",
                      "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
                      "mlp.shared_experts.down_proj": "ffn_down_shexp"}
MLA_NAMES = {"self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
             "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
             "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.k_b_proj": "attn_k_b",
             "self_attn.v_b_proj": "attn_v_b"}

LAYOUTS: dict[str, Layout] = {
    "llama": Layout("llama", permute_qk=True, vocab_size_key=True, rope_dims=True),
    "mistral": Layout("llama", permute_qk=True, vocab_size_key=True, rope_dims=True),
    "qwen2": Layout("qwen2"),
    "qwen3": Layout("qwen3"),
    "gemma3_text": Layout("gemma3", GEMMA_NAMES, norm_plus_one=True, extra=_gemma3),
    "gemma4_text": Layout("gemma4", GEMMA4_NAMES, extra=_gemma4),
    "gemma2": Layout("gemma2", GEMMA_NAMES, norm_plus_one=True, extra=_gemma2, drop_head=True),
    "smollm3": Layout("smollm3", permute_qk=True, vocab_size_key=True, rope_dims=True),
    "granite": Layout("granite", permute_qk=True, vocab_size_key=True, rope_dims=True, extra=_granite),
    "olmo2": Layout("olmo2", POST_NORM_NAMES, extra=_window_pattern),
    "seed_oss": Layout("seed_oss", {"post_attention_layernorm": "post_attention_norm"}),
    "hunyuan_v1_dense": Layout("hunyuan-dense", {"self_attn.query_layernorm": "attn_q_norm",
                                                 "self_attn.key_layernorm": "attn_k_norm"}, extra=_hunyuan),
    "glm4": Layout("glm4", {"post_self_attn_layernorm": "post_attention_norm", "post_mlp_layernorm": "post_ffw_norm",
                            "mlp.gate_up_proj": "ffn_up"}, rope_dims=True),
    "exaone4": Layout("exaone4", POST_NORM_NAMES, vocab_size_key=True, extra=_window_pattern),
    "starcoder2": Layout("starcoder2", {"mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}),
    "ernie4_5": Layout("ernie4_5"),
    "phi3": Layout("phi3", {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}, rope_dims=True,
                   extra=_phi3),
    "cohere2": Layout("cohere2", vocab_size_key=True, rope_dims=True, extra=_cohere2),
    # Issue 40: MoE families. Mixtral is written as "llama" with experts; the expert width is its
    # feed_forward_length (no expert_feed_forward_length).
    "mixtral": Layout("llama", MOE_NAMES, permute_qk=True, vocab_size_key=True, rope_dims=True, extra=_experts),
    "olmoe": Layout("olmoe", MOE_NAMES, extra=_experts),
    "qwen2_moe": Layout("qwen2moe", {**MOE_NAMES, "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
                                     "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
                                     "mlp.shared_expert.up_proj": "ffn_up_shexp",
                                     "mlp.shared_expert.down_proj": "ffn_down_shexp"}, extra=_qwen2_moe),
    "granitemoe": Layout("granitemoe", GRANITE_MOE_NAMES, permute_qk=True, vocab_size_key=True, rope_dims=True,
                         extra=_granitemoe),
    "gpt_oss": Layout("gpt-oss", {**MOE_NAMES, "mlp.router": "ffn_gate_inp", "self_attn.sinks": "attn_sinks",
                                  "post_attention_layernorm": "post_attention_norm"}, extra=_gpt_oss, state=gpt_oss_state),
    "glm4_moe": Layout("glm4moe", {**DEEPSEEK_MOE_NAMES, "post_attention_layernorm": "post_attention_norm"},
                       rope_dims=True, extra=_glm4_moe, state=selection_bias_state),
    "deepseek_v3": Layout("deepseek2", {**DEEPSEEK_MOE_NAMES, **MLA_NAMES}, extra=_deepseek2, state=mla_state),
    "deepseek_v2": Layout("deepseek2", {**DEEPSEEK_MOE_NAMES, **MLA_NAMES}, extra=_deepseek2, state=mla_state),
    "deepseek_v3-kv_b-whole": Layout("deepseek2", {**DEEPSEEK_MOE_NAMES, **MLA_NAMES, "self_attn.kv_b_proj": "attn_kv_b"},
                                     extra=_deepseek2_whole_kv_b, state=selection_bias_state),
}


def converter_metadata(cfg: Any, layout: Layout) -> dict[str, Any]:
    """The `<arch>.` keys (without the prefix) convert_hf_to_gguf.py writes for this config."""
    raw = cfg.to_dict()
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    meta: dict[str, Any] = {
        "block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": raw.get("num_key_value_heads") or cfg.num_attention_heads,
        "rope.freq_base": rope["rope_theta"],
    }
    if (eps := raw.get("rms_norm_eps")) is not None:
        meta["attention.layer_norm_rms_epsilon"] = eps
    if (eps := raw.get("layer_norm_eps", raw.get("norm_epsilon"))) is not None:
        meta["attention.layer_norm_epsilon"] = eps
    if rope.get("rope_type") in ("linear", "yarn"):
        meta["rope.scaling.type"] = rope["rope_type"]
        meta["rope.scaling.factor"] = rope["factor"]
        if rope["rope_type"] == "yarn":
            meta["rope.scaling.original_context_length"] = rope["original_max_position_embeddings"]
    if rope.get("rope_type") == "longrope":
        meta["rope.scaling.type"] = "longrope"
    head_dim = raw.get("head_dim")
    if head_dim is not None and layout.arch != "granite":
        meta["attention.key_length"] = meta["attention.value_length"] = head_dim
    if layout.vocab_size_key:
        meta["vocab_size"] = cfg.vocab_size
    if layout.rope_dims:
        full = head_dim or cfg.hidden_size // cfg.num_attention_heads
        meta["rope.dimension_count"] = int(full * rope.get("partial_rotary_factor", raw.get("partial_rotary_factor") or 1.0))
    if layout.extra is not None:
        layout.extra(cfg, meta)
    return meta


def converter_tensors(model: nn.Module, layout: Layout) -> dict[str, np.ndarray]:
    """GGUF tensor name -> array (numpy order), as the converter writes them (F32)."""
    cfg = model.config
    names = {**LLAMA_NAMES, **layout.names}
    out: dict[str, np.ndarray] = {}
    state = model.state_dict() if layout.state is None else layout.state(model.state_dict(), cfg)
    for name, tensor in _split_expert_stacks(state).items():
        if name == "lm_head.weight" and (cfg.tie_word_embeddings or layout.drop_head):
            continue
        if name.endswith("layer_scalar"):  # the converter's filter_tensors: Gemma 4's scalar gets a ".weight"
            name += ".weight"
        stem, kind = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, idx, part = stem.split(".", 3)
            gguf_name = f"blk.{idx}.{names[part]}.{kind}"
        else:
            gguf_name = f"{GLOBAL_NAMES[stem]}.{kind}"
        out[gguf_name] = _layout(name, tensor.float().numpy(), cfg, layout)
    rope = cfg.rope_parameters
    if layout.arch == "gemma4":
        out["rope_freqs.weight"] = gemma4_rope_freqs(cfg)
    if rope.get("rope_type") == "llama3":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        out["rope_freqs.weight"] = llama3_freq_factors(rope, head_dim, rope["rope_theta"])
    if rope.get("rope_type") == "longrope":
        out["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        out["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    return out


def _layout(name: str, array: np.ndarray, cfg: Any, layout: Layout) -> np.ndarray:
    if layout.permute_qk and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
        heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
        return array.reshape(heads, 2, array.shape[0] // heads // 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)
    if layout.norm_plus_one and name.endswith("norm.weight"):
        return array + 1.0
    return array


def write_converter_gguf(model: nn.Module, model_type: str, path: Path) -> Path:
    """`model` as an F32 GGUF laid out as the converter writes `model_type`."""
    import gguf

    layout = LAYOUTS[model_type]
    writer = gguf.GGUFWriter(str(path), layout.arch)
    for key, value in converter_metadata(model.config, layout).items():
        _add(writer, f"{layout.arch}.{key}", value)
    for name, array in converter_tensors(model, layout).items():
        writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: Any, key: str, value: Any) -> None:
    if key.endswith("rope.scaling.type"):
        writer.add_string(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    else:
        writer.add_float32(key, float(value))
