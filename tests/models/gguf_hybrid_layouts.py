"""A tiny transformers hybrid (issue 41) written as a GGUF the way llama.cpp's convert_hf_to_gguf.py
(conversion/qwen.py, nemotron.py, granite.py, lfm2.py, falcon_h1.py, mamba.py) writes it: the architecture,
the `<arch>.` keys the loader reads, tensor names and every layout change the converter makes:

- Gated DeltaNet (qwen35, qwen35moe, qwen3next): A_log stored as -exp(A_log), dt_bias as `ssm_dt.bias`, the conv
  squeezed to [C, K], every (1 + w) RMSNorm but the gated one stored as 1 + w; Qwen3-Next's in_proj_qkvz split
  into attn_qkv and attn_gate (ssm_ba kept fused); Qwen3.5's value heads reordered from grouped to tiled
  (`_LinearAttentionVReorderBase`: q/k/v rows, z, a, b, A_log, dt_bias, conv channels, out_proj columns);
- Mamba-2 (nemotron_h, nemotron_h_moe, granitehybrid, falcon-h1): A as -exp(A_log) [H, 1], D [H, 1], the conv
  squeezed, the gated norm [groups, inner / groups]; Granite's q/k rows permuted (LlamaModel), its experts and
  shared MLP split; Falcon-H1's muP multipliers folded into the weights; Nemotron-H's experts stacked;
- LFM2: the short conv squeezed, the final norm as `token_embd_norm`.

Checked against the converter's own files on the same checkpoints (test_gguf_hybrids.py's converter test)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .gguf_layouts import _add

ARCH = {"qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next",
        "nemotron_h": "nemotron_h", "granitemoehybrid": "granitehybrid", "falcon_h1": "falcon-h1", "lfm2": "lfm2"}

_ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output", "q_norm": "attn_q_norm",
         "k_norm": "attn_k_norm", "out_proj": "attn_output", "q_layernorm": "attn_q_norm", "k_layernorm": "attn_k_norm"}
_MAMBA = {"in_proj": "ssm_in", "conv1d": "ssm_conv1d", "dt_bias": "ssm_dt", "A_log": "ssm_a", "D": "ssm_d",
          "norm": "ssm_norm", "out_proj": "ssm_out"}
_QWEN_LINEAR = {"in_proj_qkvz": "attn_qkv", "in_proj_qkv": "attn_qkv", "in_proj_z": "attn_gate", "in_proj_b": "ssm_beta", "in_proj_a": "ssm_alpha",
                "in_proj_ba": "ssm_ba", "conv1d": "ssm_conv1d", "dt_bias": "ssm_dt", "A_log": "ssm_a", "norm": "ssm_norm",
                "out_proj": "ssm_out"}
_FFN = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down", "w1": "ffn_gate", "w3": "ffn_up",
        "w2": "ffn_down"}


def model_type_of(model: nn.Module) -> str:
    return model.config.model_type


def hybrid_gguf_tensors(model: nn.Module) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 array (numpy order: PyTorch's), as the converter writes this model."""
    cfg, kind = model.config, model_type_of(model)
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    out: dict[str, np.ndarray] = {}
    for name, t in _experts_stacked(state, cfg, kind).items():
        gguf = _gguf_name(name, cfg, kind)
        if gguf is None:
            continue
        for gname, array in _transform(gguf, name, t, cfg, kind):
            out[gname] = array.numpy()
    return out


def _experts_stacked(state: dict[str, torch.Tensor], cfg: Any, kind: str) -> dict[str, torch.Tensor]:
    """Per-expert tensors stacked [E, ...] (the converter's merge), transformers 5's stacks split as the converter
    writes them (gate and up apart)."""
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        if m := re.match(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$", name):
            per_expert.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = t
        elif name.endswith("experts.gate_up_proj"):  # transformers 5's stacks [E, 2I, H], gate first
            gate, up = t.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj")], out[name.replace("gate_up_proj", "up_proj")] = gate, up
        elif name.endswith("block_sparse_moe.input_linear.weight"):  # Granite's
            gate, up = t.chunk(2, dim=1)
            stem = name[:-len("input_linear.weight")]
            out[stem + "experts.gate_proj"], out[stem + "experts.up_proj"] = gate, up
        elif name.endswith("block_sparse_moe.output_linear.weight"):
            out[name[:-len("output_linear.weight")] + "experts.down_proj"] = t
        elif name.endswith("shared_mlp.input_linear.weight"):
            gate, up = t.chunk(2, dim=0)
            stem = name[:-len("input_linear.weight")]
            out[stem + "gate_proj.weight"], out[stem + "up_proj.weight"] = gate, up
        elif name.endswith("shared_mlp.output_linear.weight"):
            out[name[:-len("output_linear.weight")] + "down_proj.weight"] = t
        else:
            out[name] = t
    for stem, experts in per_expert.items():
        out[stem] = torch.stack([experts[e] for e in range(len(experts))])
    return out


def _gguf_name(name: str, cfg: Any, kind: str) -> str | None:
    if name in ("model.embed_tokens.weight", "backbone.embeddings.weight", "model.embeddings.weight"):
        return "token_embd.weight"
    if name == "lm_head.weight":
        return None if cfg.tie_word_embeddings else "output.weight"
    if name.startswith(("model.norm.", "model.norm_f.", "backbone.norm_f.", "model.final_layernorm.")):
        return "output_norm." + name.rsplit(".", 1)[1]
    if name.startswith("model.embedding_norm."):
        return "token_embd_norm." + name.rsplit(".", 1)[1]
    m = re.match(r"^(?:model|backbone)\.layers\.(\d+)\.(.+)$", name)
    assert m, name
    layer, rest = m.groups()
    parts = rest.split(".")
    kind_suffix = parts[-1] if parts[-1] in ("weight", "bias") else ""
    body = parts[:-1] if kind_suffix else parts
    gguf = _part(body, cfg, kind, int(layer))
    if gguf == "ssm_dt":
        return f"blk.{layer}.ssm_dt.bias"
    if gguf.endswith("_exps"):  # the stacks (transformers 5's parameters have no .weight)
        kind_suffix = "weight"
    if kind == "falcon_h1" and gguf == "ffn_norm":  # llama.cpp's falcon-h1 names it bare
        kind_suffix = ""
    return f"blk.{layer}.{gguf}" + (f".{kind_suffix}" if kind_suffix else "")


def _part(body: list[str], cfg: Any, kind: str, layer: int) -> str:
    head, last = body[0], body[-1]
    if head in ("input_layernorm", "operator_norm"):
        return "attn_norm"
    if head == "norm" and len(body) == 1:  # Nemotron-H's block norm
        return "attn_norm"
    if head in ("post_attention_layernorm", "pre_ff_layernorm", "ffn_norm"):
        return "post_attention_norm" if kind.startswith("qwen3") else "ffn_norm"
    if head in ("self_attn",):
        return _ATTN[last]
    if head == "linear_attn":
        return _QWEN_LINEAR[body[1]]
    if head == "mamba":
        return _MAMBA[body[1]]
    if head == "conv":  # LFM2's short conv
        return {"conv": "shortconv.conv", "in_proj": "shortconv.in_proj", "out_proj": "shortconv.out_proj"}[body[1]]
    if head == "mixer":  # Nemotron-H: by the layer's kind
        sub = body[1]
        if sub in _MAMBA and "in_proj" in _layer_params(cfg, layer):
            return _MAMBA[sub]
        if sub in ("q_proj", "k_proj", "v_proj", "o_proj"):
            return _ATTN[sub]
        return _moe_part(body[1:], prefix_ffn=True)
    if head in ("mlp", "feed_forward", "block_sparse_moe", "shared_mlp"):
        if head == "shared_mlp":
            shared = bool(getattr(cfg, "num_local_experts", 0))
            return _FFN[body[1]] + ("_shexp" if shared else "")
        return _moe_part(body[1:], prefix_ffn=False)
    raise KeyError(".".join(body))


def _layer_params(cfg: Any, layer: int) -> set[str]:
    kinds = getattr(cfg, "layers_block_type", None) or []
    return {"in_proj"} if kinds and kinds[layer] in ("mamba", "linear_attention") else set()


def _moe_part(body: list[str], prefix_ffn: bool) -> str:
    sub = body[0]
    if sub in _FFN and len(body) == 1:
        return _FFN[sub]
    if sub == "gate":
        return "exp_probs_b" if body[-1] == "e_score_correction_bias" else "ffn_gate_inp"
    if sub == "router":  # Granite's router.layer
        return "ffn_gate_inp"
    if sub == "experts":
        return _FFN[body[1]] + "_exps"
    if sub in ("shared_expert", "shared_experts"):
        return _FFN[body[1]] + "_shexp"
    if sub == "shared_expert_gate":
        return "ffn_gate_inp_shexp"
    if sub == "fc1_latent_proj":
        return "ffn_latent_down"
    if sub == "fc2_latent_proj":
        return "ffn_latent_up"
    raise KeyError(".".join(body))


def _transform(gguf: str, name: str, t: torch.Tensor, cfg: Any, kind: str) -> list[tuple[str, torch.Tensor]]:
    if gguf.endswith(".exp_probs_b"):
        return [(gguf + ".bias", t)]
    if kind in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"):
        return _qwen(gguf, name, t, cfg, kind)
    if gguf.endswith((".ssm_a", ".ssm_d")):
        t = -torch.exp(t) if gguf.endswith(".ssm_a") else t
        return [(gguf, t.reshape(-1, 1))]
    if gguf.endswith(".ssm_conv1d.weight"):
        return [(gguf, t.squeeze(1))]
    if gguf.endswith(".ssm_norm.weight"):
        groups = getattr(cfg, "n_groups", None) or getattr(cfg, "mamba_n_groups", 1)
        return [(gguf, t.reshape(groups, -1))]
    if gguf.endswith(".shortconv.conv.weight"):
        return [(gguf, t.squeeze(1))]
    if kind == "granitemoehybrid" and gguf.endswith((".attn_q.weight", ".attn_k.weight")):
        heads = cfg.num_attention_heads if ".attn_q." in gguf else cfg.num_key_value_heads
        return [(gguf, t.reshape(heads, 2, t.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(t.shape))]
    if kind == "falcon_h1":
        return [(gguf, _falcon_fold(name, t, cfg))]
    return [(gguf, t)]


def _falcon_fold(name: str, t: torch.Tensor, cfg: Any) -> torch.Tensor:
    """FalconH1Model.modify_tensors: each multiplier times its weight (and bias), first match wins."""
    m_gate, m_down = cfg.mlp_multipliers
    if "down_proj" in name:
        return t * m_down
    if "gate_proj" in name:
        return t * m_gate
    if "k_proj" in name:
        return t * cfg.key_multiplier * cfg.attention_in_multiplier
    if "q_proj" in name or "v_proj" in name:
        return t * cfg.attention_in_multiplier
    if "o_proj" in name:
        return t * cfg.attention_out_multiplier
    if "out_proj" in name:
        return t * cfg.ssm_out_multiplier
    if "in_proj" in name:
        t = t * cfg.ssm_in_multiplier
        inner, gs = cfg.mamba_d_ssm, cfg.mamba_n_groups * cfg.mamba_d_state
        bounds = [0, inner, 2 * inner, 2 * inner + gs, 2 * inner + 2 * gs, t.shape[0]]
        for i, mult in enumerate(cfg.ssm_multipliers):
            t[bounds[i]:bounds[i + 1]] *= mult
        return t
    if "lm_head" in name:
        return t * cfg.lm_head_multiplier
    if "embed_tokens" in name:
        return t * cfg.embedding_multiplier
    return t


def _qwen(gguf: str, name: str, t: torch.Tensor, cfg: Any, kind: str) -> list[tuple[str, torch.Tensor]]:
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    g = hv // hk
    tiled = kind != "qwen3_next" and hk != hv and ".linear_attn." in name

    def reorder(x: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:  # grouped -> tiled along `dim`
        shape = list(x.shape)
        x = x.reshape(*shape[:dim], hk, g, head_dim, *shape[dim + 1:])
        return x.transpose(dim, dim + 1).reshape(shape)

    if name.endswith("in_proj_qkvz.weight"):  # Qwen3-Next: split per key head into qkv and z
        parts = t.reshape(hk, -1, t.shape[-1]).split((dk, dk, g * dv, g * dv), dim=1)
        q, k, v, z = (p.reshape(-1, t.shape[-1]) for p in parts)
        return [(gguf.replace("attn_qkv", "attn_qkv"), torch.cat((q, k, v))),
                (gguf.replace("attn_qkv", "attn_gate"), z)]
    if tiled:
        if name.endswith("in_proj_qkv.weight"):
            t = torch.cat((t[:2 * hk * dk], reorder(t[2 * hk * dk:], 0, dv)))
        elif name.endswith("in_proj_z.weight"):
            t = reorder(t, 0, dv)
        elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            t = reorder(t, 0, 1)
        elif name.endswith("conv1d.weight"):
            t = torch.cat((t[:2 * hk * dk], reorder(t[2 * hk * dk:], 0, dv)))
        elif name.endswith("out_proj.weight"):
            t = reorder(t, 1, dv)
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    return [(gguf, t)]


def hybrid_gguf_metadata(model: nn.Module) -> dict[str, Any]:
    """The `<arch>.` keys (no prefix) the converter writes that the loader reads."""
    cfg, kind = model.config, model_type_of(model)
    meta: dict[str, Any] = {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
                            "embedding_length": cfg.hidden_size, "rope.freq_base": _rope_theta(cfg)}
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    meta.update({"attention.head_count": heads, "attention.head_count_kv": kv,
                 "attention.key_length": head_dim, "attention.value_length": head_dim})
    if kind.startswith("qwen3"):
        meta.update({"feed_forward_length": cfg.intermediate_size, "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
                     "ssm.conv_kernel": cfg.linear_conv_kernel_dim, "ssm.state_size": cfg.linear_key_head_dim,
                     "ssm.group_count": cfg.linear_num_key_heads, "ssm.time_step_rank": cfg.linear_num_value_heads,
                     "ssm.inner_size": cfg.linear_value_head_dim * cfg.linear_num_value_heads,
                     "full_attention_interval": getattr(cfg, "full_attention_interval", 4),
                     "rope.dimension_count": int(head_dim * cfg.rope_parameters.get("partial_rotary_factor", 0.25))})
        if kind != "qwen3_5_text":
            meta.update({"expert_count": cfg.num_experts, "expert_used_count": cfg.num_experts_per_tok,
                         "expert_feed_forward_length": cfg.moe_intermediate_size,
                         "expert_shared_feed_forward_length": cfg.shared_expert_intermediate_size})
    elif kind == "nemotron_h":
        kinds = list(cfg.layers_block_type)
        moe = "moe" in kinds
        meta.update(_mamba_meta(cfg.hidden_size, cfg.mamba_num_heads * cfg.mamba_head_dim, cfg.mamba_num_heads,
                                cfg.ssm_state_size, cfg.n_groups, cfg.conv_kernel))
        meta["attention.head_count_kv"] = [kv if k in ("full_attention", "attention") else 0 for k in kinds]
        meta["attention.layer_norm_epsilon" if moe else "attention.layer_norm_rms_epsilon"] = cfg.layer_norm_epsilon
        width = cfg.moe_intermediate_size if moe else cfg.intermediate_size
        meta["feed_forward_length"] = [width if k == ("moe" if moe else "mlp") else 0 for k in kinds]
        if moe:
            meta.update({"expert_count": cfg.n_routed_experts, "expert_used_count": cfg.num_experts_per_tok,
                         "expert_feed_forward_length": cfg.moe_intermediate_size,
                         "expert_shared_feed_forward_length": cfg.moe_shared_expert_intermediate_size,
                         "expert_shared_count": cfg.n_shared_experts, "expert_weights_norm": cfg.norm_topk_prob,
                         "expert_weights_scale": cfg.routed_scaling_factor, "expert_group_count": cfg.n_group,
                         "expert_group_used_count": cfg.topk_group})
    elif kind == "granitemoehybrid":
        meta.update(_mamba_meta(cfg.hidden_size, cfg.mamba_n_heads * cfg.mamba_d_head, cfg.mamba_n_heads,
                                cfg.mamba_d_state, cfg.mamba_n_groups, cfg.mamba_d_conv))
        meta.update({"feed_forward_length": cfg.intermediate_size, "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
                     "attention.head_count_kv": [kv if t == "attention" else 0 for t in _granite_kinds(cfg)],
                     "attention.scale": cfg.attention_multiplier, "embedding_scale": cfg.embedding_multiplier,
                     "residual_scale": cfg.residual_multiplier, "logit_scale": cfg.logits_scaling,
                     "rope.scaling.finetuned": False, "context_length": 2**20})
        if cfg.num_local_experts:
            meta.update({"expert_count": cfg.num_local_experts, "expert_used_count": cfg.num_experts_per_tok,
                         "expert_shared_feed_forward_length": cfg.shared_intermediate_size})
        else:
            meta["feed_forward_length"] = cfg.shared_intermediate_size
        meta.pop("attention.key_length"), meta.pop("attention.value_length")
    elif kind == "falcon_h1":
        meta.update(_mamba_meta(cfg.hidden_size, cfg.mamba_d_ssm, cfg.mamba_n_heads, cfg.mamba_d_state,
                                cfg.mamba_n_groups, cfg.mamba_d_conv))
        meta.update({"feed_forward_length": cfg.intermediate_size, "attention.head_count": heads,
                     "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps, "context_length": cfg.max_position_embeddings})
    elif kind == "lfm2":
        meta.update({"attention.head_count_kv": [0 if t == "conv" else kv for t in cfg.layer_types],
                     "shortconv.l_cache": cfg.conv_L_cache, "attention.layer_norm_rms_epsilon": cfg.norm_eps,
                     # the converter's block_auto_adjust_ff_dim width: the one transformers built
                     "feed_forward_length": model.model.layers[0].feed_forward.w1.out_features})
        meta.pop("attention.key_length"), meta.pop("attention.value_length")
    return meta


def _granite_kinds(cfg: Any) -> list[str]:
    return ["mamba" if t in ("mamba", "linear_attention") else "attention" for t in cfg.layer_types]


def _mamba_meta(hidden: int, inner: int, heads: int, state: int, groups: int, kernel: int) -> dict[str, Any]:
    return {"ssm.conv_kernel": kernel, "ssm.inner_size": inner, "ssm.state_size": state, "ssm.time_step_rank": heads,
            "ssm.group_count": groups}


def _rope_theta(cfg: Any) -> float:
    rope = getattr(cfg, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def write_hybrid_gguf(model: nn.Module, path: Path, qtype: str = "F32", chat_template: str | None = None) -> Path:
    """`model` as a GGUF of `qtype` ("F32", "F16" or "Q8_0"): as the converter's --outtype, 1-D tensors (norms,
    biases, A, D) and the convs stay F32, and a Q8_0 tensor whose rows are not whole blocks falls back to F16."""
    import gguf

    arch = ARCH[model_type_of(model)]
    if "moe" in (getattr(model.config, "layers_block_type", None) or ()):
        arch = "nemotron_h_moe"  # the converter's NemotronHModel with MoE parameters
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in hybrid_gguf_metadata(model).items():
        _add(writer, f"{arch}.{key}", value)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for name, array in hybrid_gguf_tensors(model).items():
        array = np.ascontiguousarray(array, dtype=np.float32)
        keep_f32 = array.ndim < 2 or ".ssm_conv1d." in name or ".shortconv.conv." in name or name.endswith(
            (".ssm_a", ".ssm_d", "exp_probs_b.bias", "ffn_gate_inp.weight", "ssm_norm.weight"))
        if qtype == "F32" or keep_f32:
            writer.add_tensor(name, array)
        elif qtype == "F16" or array.shape[-1] % 32:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            q = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
