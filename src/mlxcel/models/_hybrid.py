"""What the hybrid recurrent families share at the checkpoint: their global modules' own names."""

from __future__ import annotations

from typing import Any


def rename_prefixes(weights: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """The checkpoint's entries with each prefix in `names` replaced (e.g. Nemotron-H's
    `model.embeddings.` -> `model.embed_tokens.`); values (tensors or lazy readers) as they were."""
    out = {}
    for key, value in weights.items():
        old = next((p for p in names if key.startswith(p)), None)
        out[key if old is None else names[old] + key[len(old):]] = value
    return out


def config_float(value: Any) -> float:
    """A float of config.json; transformers 5 writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def time_step_limit(config: dict[str, Any]) -> tuple[float, float]:
    """Mamba-2's dt clamp (`time_step_limit`), (0, inf) when unset."""
    low, high = config.get("time_step_limit") or (0.0, float("inf"))
    return config_float(low), config_float(high)


# ---- GGUF (issue 41): a Mamba-2 mixer as llama.cpp's converter writes it (Mamba2Model.modify_tensors) ----

def mamba2_gguf_names(prefix: str) -> dict[str, str]:
    """llama.cpp's Mamba-2 tensors (after `blk.N.`) -> the mixer's parameters under `prefix` (Nemotron-H's
    `mixer`, Granite 4's and Falcon-H1's `mamba`); whole names for the bare `ssm_a` / `ssm_d` and the renamed
    `ssm_dt.bias` (HF `dt_bias`)."""
    return {"ssm_in": f"{prefix}.in_proj", "ssm_conv1d": f"{prefix}.conv1d", "ssm_dt.bias": f"{prefix}.dt_bias",
            "ssm_a": f"{prefix}.A_log", "ssm_d": f"{prefix}.D", "ssm_norm": f"{prefix}.norm",
            "ssm_out": f"{prefix}.out_proj"}


def mamba2_gguf_shape(gguf: Any) -> dict[str, Any]:
    """The mixer's shape from the `ssm.*` keys (time_step_rank: the heads; inner_size: heads x head dim)
    and its biases from the tensors layer 0 or the first Mamba layer holds."""
    heads, inner = gguf.arch_value("ssm.time_step_rank"), gguf.arch_value("ssm.inner_size")
    first = next((name.split(".")[1] for name in gguf.tensors if name.endswith(".ssm_in.weight")), "0")
    return {"conv_kernel": gguf.arch_value("ssm.conv_kernel"), "state_size": gguf.arch_value("ssm.state_size"),
            "n_groups": gguf.arch_value("ssm.group_count") or 1, "num_heads": heads, "head_dim": inner // heads,
            "inner_size": inner, "conv_bias": f"blk.{first}.ssm_conv1d.bias" in gguf.tensors,
            "proj_bias": f"blk.{first}.ssm_in.bias" in gguf.tensors}


def gguf_layer_kinds(gguf: Any, num_layers: int) -> list[str]:
    """Each layer's job by the tensors it holds: "mamba", "attention", "moe" (routed experts) or "mlp"."""
    def kind(i: int) -> str:
        if f"blk.{i}.ssm_in.weight" in gguf.tensors:
            return "mamba"
        if f"blk.{i}.attn_q.weight" in gguf.tensors:
            return "attention"
        return "moe" if f"blk.{i}.ffn_up_exps.weight" in gguf.tensors else "mlp"
    return [kind(i) for i in range(num_layers)]


def gguf_rows(gguf: Any, part: str) -> int:
    """The rows of the first layer's `part` tensor (e.g. "attn_k.weight"; 0 where no layer holds one)."""
    shape = next((t.shape for name, t in gguf.tensors.items() if name.endswith(f".{part}")), (0,))
    return int(shape[0])


def per_layer_max(value: Any) -> Any:
    """A per-layer GGUF array (head_count_kv, feed_forward_length of the hybrids: 0 where a layer has none) as
    its one nonzero value; a scalar as it is."""
    if isinstance(value, (list, tuple)):
        return max(value) if value else None
    return value


def fix_mamba2_weights(state: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Undo the converter's Mamba-2 layouts for the mixer under `prefix`: A stored as -exp(A_log) [H, 1], D
    as [H, 1], the conv's channel axis squeezed, the gated norm's weight as [groups, inner / groups]."""
    import torch

    for name, value in list(state.items()):
        if f".{prefix}." not in name:
            continue
        if name.endswith(".A_log"):
            state[name] = torch.log(-value).reshape(-1)
        elif name.endswith(".D"):
            state[name] = value.reshape(-1)
        elif name.endswith(".conv1d.weight") and value.dim() == 2:
            state[name] = value.unsqueeze(1)
        elif name.endswith(f"{prefix}.norm.weight"):
            state[name] = value.reshape(-1)
    return state
