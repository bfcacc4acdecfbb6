"""Turn a checkpoint (GGUF file or HF folder) into a model module of the right family.

Both formats end in the same form: an HF-style config dict with `model_type`, and a state
dict keyed by HF parameter names. Families are modules under `mlxcel.models`, found by
importlib from `model_type` (never an if/elif ladder).
"""

from __future__ import annotations

import importlib
import json
import logging
import pkgutil
import re
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import numpy as np
import torch

from mlxcel.layers.quant import Int4Levels, Int8Levels
from mlxcel.loading.errors import ModelLoadError
from mlxcel.loading.gguf import GGUFFile
from mlxcel.models._gguf import sliding_layer_types

log = logging.getLogger(__name__)

# GGUF metadata key (after "<arch>.") -> HF config key.
GGUF_CONFIG_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.sliding_window": "sliding_window",
    "attention.layer_norm_epsilon": "layer_norm_eps",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "rope.freq_base": "rope_theta",
    "nextn_predict_layers": "num_nextn_predict_layers",  # MTP layers (F10's decision reads it)
    "expert_count": "num_experts",  # mixture-of-experts families (issue 40)
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}

# GGUF tensor name (per-layer part after "blk.N.") -> HF name; families may override entries.
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# GGUF general.architecture -> our model_type, where llama.cpp names it otherwise (one table:
# every other architecture is its model_type). Mistral and Mixtral are written as "llama".
GGUF_ARCHITECTURES = {
    "hunyuan-dense": "hunyuan_v1_dense",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "glm4moe": "glm4_moe",
    "deepseek2": "deepseek_v3",  # V2 files too: deepseek_v3.gguf_config reads the router (V2: softmax)
    "ernie4_5-moe": "ernie4_5_moe",
    "gemma4": "gemma4_text",  # (the text model; a "gemma4" HF config is the multimodal one)
    # issue 41: the hybrids
    "qwen35": "qwen3_5_text",
    "qwen35moe": "qwen3_5_moe_text",
    "qwen3next": "qwen3_next",
    "nemotron_h_moe": "nemotron_h",
    "granitehybrid": "granitemoehybrid",
    "falcon-h1": "falcon_h1",
}
GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_GLOBAL_RE = re.compile(r"^(.+)\.(weight|bias)$")


def supported_model_types(*, generative: bool = True) -> list[str]:
    """Family modules under mlxcel.models; `generative` keeps those whose Model yields logits."""
    import mlxcel.models as pkg

    names = [m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_")]
    modules = {n: importlib.import_module(f"mlxcel.models.{n}") for n in names}
    return sorted(n for n, mod in modules.items()
                  if hasattr(mod, "Model") and (not generative or hasattr(mod.Model, "compute_logits")))


FALLBACK_MODULE = "mlxcel.models._transformers"  # transformers' own modeling code (issue 40)


def family_module(model_type: str, *, kind: str = "model type") -> ModuleType:
    """The family module for `model_type`; `kind` names the field in the error ("GGUF architecture").

    A model_type with no module of its own takes the transformers fallback where transformers knows it
    (HF checkpoints only: a GGUF's tensors are named and laid out for llama.cpp, not for transformers)."""
    module = None
    if isinstance(model_type, str) and model_type and not model_type.startswith("_"):
        try:
            module = importlib.import_module(f"mlxcel.models.{model_type}")
        except ModuleNotFoundError as exc:
            if exc.name != f"mlxcel.models.{model_type}":  # a family's own missing import is a real bug
                raise
    if module is None and kind == "model type":
        fallback = importlib.import_module(FALLBACK_MODULE)
        module = fallback if fallback.knows(model_type) else None
    if module is None or not hasattr(module, "Model"):
        supported = ", ".join(supported_model_types())
        fallback = "; and any decoder model_type transformers knows" if kind == "model type" else ""
        raise ModelLoadError(f"{kind} {model_type!r} is not supported (supported: {supported}{fallback})")
    return module


def family_implementation(model_type: str) -> str:
    """Which code runs `model_type`: "native" (a family module of ours) or "transformers" (the fallback)."""
    try:
        return str(getattr(family_module(model_type), "IMPLEMENTATION", "native"))
    except ModelLoadError:  # a model served by no family module (block diffusion's worker): ours
        return "native"


def gguf_config(gguf: GGUFFile) -> dict[str, Any]:
    """HF-style config dict from GGUF metadata (families refine it with `gguf_config`)."""
    arch = gguf.architecture
    if not arch:
        raise ModelLoadError(f"{gguf.path}: GGUF metadata has no general.architecture")
    model_type = GGUF_ARCHITECTURES.get(arch, arch)
    config: dict[str, Any] = {"model_type": model_type}
    for key, hf_key in GGUF_CONFIG_KEYS.items():
        value = gguf.arch_value(key)
        if value is not None:
            config[hf_key] = value
    _head_fields(config, gguf)
    if (layer_types := sliding_layer_types(gguf, config.get("num_hidden_layers", 0), None)) is not None:
        config["layer_types"] = layer_types
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    embedding = gguf.tensors.get("token_embd.weight")  # converters for some architectures write no vocab_size
    config["vocab_size"] = (gguf.arch_value("vocab_size") or (len(tokens) if tokens else None)
                            or (embedding.shape[0] if embedding is not None else None))
    config["tie_word_embeddings"] = "output.weight" not in gguf.tensors
    scaling_type = gguf.arch_value("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        config["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": gguf.arch_value("rope.scaling.factor", 1.0),
            "original_max_position_embeddings": gguf.arch_value("rope.scaling.original_context_length"),
        }
    module = family_module(model_type, kind="GGUF architecture")
    refine: Callable[[dict[str, Any], GGUFFile], dict[str, Any]] | None = getattr(module, "gguf_config", None)
    return refine(config, gguf) if refine else config


def _head_fields(config: dict[str, Any], gguf: GGUFFile) -> None:
    """head_dim (llama.cpp leaves `key_length` out when heads split the hidden size evenly) and
    partial rotary from `rope.dimension_count` (the rotated dimensions of a head)."""
    if "hidden_size" not in config or not config.get("num_attention_heads"):
        return
    head_dim = config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    rope_dim = gguf.arch_value("rope.dimension_count")
    if rope_dim and rope_dim != head_dim:
        config["partial_rotary_factor"] = rope_dim / head_dim


def gguf_state_dict(gguf: GGUFFile, module: ModuleType, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Dequantized tensors keyed by HF names, with GGUF-specific layouts undone."""
    names = _hf_names(gguf, module)
    for name in sorted(set(gguf.tensors) - set(names.values())):
        log.debug("skipping GGUF tensor %s (no HF counterpart)", name)
    state = {hf_name: torch.from_numpy(gguf.dequantize(name)) for hf_name, name in names.items()}
    fix = getattr(module, "fix_gguf_weights", None)
    return fix(state, config) if fix else state


def gguf_readers(gguf: GGUFFile, module: ModuleType, config: dict[str, Any]) -> dict[str, Callable[[str], torch.Tensor]]:
    """HF name -> a reader that dequantizes that tensor from the mapped file (lazy weights, A6),
    with the family's GGUF layout fix applied to it alone."""
    fix = getattr(module, "fix_gguf_weights", None)

    def reader(gguf_name: str) -> Callable[[str], torch.Tensor]:
        def read(hf_name: str) -> torch.Tensor:
            tensor = torch.from_numpy(gguf.dequantize(gguf_name))  # a new array: writeable
            return fix({hf_name: tensor}, config)[hf_name] if fix else tensor
        return read

    return {hf_name: reader(name) for hf_name, name in _hf_names(gguf, module).items()}


class GGUFPackedWeights:
    """`layers.quant.PackedWeights` of a GGUF file (set on the model as `model.packed_weights`): a
    4-bit tensor's levels, steps and lows as stored, with the family's layout fix applied to each
    of the three (a family's `fix_gguf_weights` must therefore only move rows of a linear's weight,
    as Llama's q/k un-permutation does)."""

    def __init__(self, gguf: GGUFFile, module: ModuleType, config: dict[str, Any]) -> None:
        self.gguf, self.config = gguf, config
        self.names = _hf_names(gguf, module)
        self.fix = getattr(module, "fix_gguf_weights", None)

    def int4_levels(self, name: str) -> Int4Levels | None:
        stored = self.gguf.int4_levels(self.names[name]) if name in self.names else None
        if stored is None:
            return None
        q, step, low, units = (self._fixed(name, array) for array in stored)
        return Int4Levels(q, step, low, units)

    def int8_levels(self, name: str) -> Int8Levels | None:
        stored = self.gguf.int8_levels(self.names[name]) if name in self.names else None
        if stored is None:
            return None
        codes, scale, low, units = (self._fixed(name, array) for array in stored)
        return Int8Levels(codes, scale, low, units)

    def _fixed(self, name: str, array: np.ndarray | None) -> torch.Tensor | None:
        """One part of parameter `name` as a tensor, its rows moved as the family's fix moves the weight's."""
        if array is None:
            return None
        part = torch.from_numpy(array)
        return self.fix({name: part}, self.config)[name] if self.fix else part


def _hf_names(gguf: GGUFFile, module: ModuleType) -> dict[str, str]:
    """HF parameter name -> the GGUF tensor that holds it (tensors with no HF counterpart left out)."""
    layer_names = {**GGUF_LAYER_NAMES, **getattr(module, "GGUF_LAYER_NAMES", {})}
    global_names = {**GGUF_GLOBAL_NAMES, **getattr(module, "GGUF_GLOBAL_NAMES", {})}
    return {hf_name: name for name in gguf.tensors
            if (hf_name := _hf_name(name, layer_names, global_names)) is not None}


def _hf_name(name: str, layer_names: dict[str, str], global_names: dict[str, str]) -> str | None:
    if m := _LAYER_RE.match(name):
        layer, rest = m.groups()
        if rest in layer_names:  # a whole name: a bare tensor (the SSMs' `ssm_a`) or one whose kind changes (`ssm_dt.bias`)
            return f"model.layers.{layer}.{layer_names[rest]}"
        part, _, kind = rest.rpartition(".")
        hf_part = layer_names.get(part) if kind in ("weight", "bias") else None
        return f"model.layers.{layer}.{hf_part}.{kind}" if hf_part else None
    if m := _GLOBAL_RE.match(name):
        part = global_names.get(m.group(1))
        return f"{part}.{m.group(2)}" if part else None
    return None


def hf_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read the model config ({exc})") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: config.json is not a JSON object")
    if "text_config" in config and "model_type" in config["text_config"]:
        config = _text_config(config)
    if "model_type" not in config:
        raise ModelLoadError(f"{path}: config.json has no model_type")
    return config


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's text fields; a vision-language family of ours (models/_vision.py) keeps its
    model_type and the whole top-level config under "vision" (issue 43)."""
    # issue 42: the quantization block sits at the top level of a multimodal config
    quant = {key: config[key] for key in ("quantization", "quantization_config") if key in config}
    text = {**config["text_config"], "tie_word_embeddings": config.get("tie_word_embeddings", True), **quant}
    top_type = config.get("model_type")
    if config.get("vision_config") is None or not _is_vision_language(top_type):
        return text
    return {**text, "model_type": top_type, "text_model_type": text["model_type"], "vision": config}


def _is_vision_language(model_type: object) -> bool:
    if not isinstance(model_type, str) or not model_type.isidentifier() or model_type.startswith("_"):
        return False
    try:
        module = importlib.import_module(f"mlxcel.models.{model_type}")
    except ImportError:
        return False
    return bool(getattr(module, "IS_VISION_LANGUAGE", False))


def hf_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights found")
    state: dict[str, torch.Tensor] = {}
    for file in files:  # a sharded checkpoint's index only lists these same files
        try:
            state.update(load_file(str(file)))
        except Exception as exc:  # noqa: BLE001 - safetensors raises several kinds
            raise ModelLoadError(f"{file}: cannot read safetensors weights ({exc})") from exc
    return state


def build_model(config: dict[str, Any], state: dict[str, Any], *,
                device: torch.device | str, dtype: torch.dtype, lazy: bool = False) -> torch.nn.Module:
    """Instantiate the family's Model from config and load `state` strictly.

    `lazy`: `state` maps names to readers (loading/lazy.py); parameters stay on the meta device
    until the module holding them first runs."""
    module = family_module(config["model_type"])
    try:
        args = module.ModelArgs.from_dict(config)
    except (ValueError, TypeError, KeyError) as exc:  # a family refusing a setting, or a missing field
        raise ModelLoadError(f"{config['model_type']} config cannot be used: {exc}") from exc
    try:
        with torch.device("meta"):
            model = module.Model(args)
        state = module.Model.sanitize(state, args) if hasattr(module.Model, "sanitize") else state
    except ValueError as exc:  # a family refusing what it found building the model or reading its weights
        raise ModelLoadError(f"{config['model_type']} cannot be loaded: {exc}") from exc
    if lazy:
        return _lazy_model(model, config, state, device, dtype)
    model = model.to_empty(device=device)
    missing, unexpected = _load_state(model, state, dtype)
    if missing or unexpected:
        raise ModelLoadError(
            f"checkpoint does not match the {config['model_type']} model: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    _reset_buffers(model, device)
    return model.eval()


def _lazy_model(model: torch.nn.Module, config: dict[str, Any], readers: dict[str, Any],
                device: torch.device | str, dtype: torch.dtype) -> torch.nn.Module:
    from mlxcel.loading.lazy import LazyWeights

    params = {name for name, _ in model.named_parameters()}
    missing, unexpected = params - set(readers), set(readers) - params
    if missing or unexpected:
        raise ModelLoadError(
            f"checkpoint does not match the {config['model_type']} model: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.lazy_weights = LazyWeights(model, readers, device, dtype)
    _reset_buffers(model, device)
    return model.eval()


def _load_state(model: torch.nn.Module, state: dict[str, torch.Tensor],
                dtype: torch.dtype) -> tuple[set[str], set[str]]:
    params = dict(model.named_parameters())
    missing = set(params) - set(state)
    unexpected = set(state) - set(params)
    with torch.no_grad():
        for name, param in params.items():
            if name in state:
                value = state[name]
                if value.shape != param.shape:
                    raise ModelLoadError(f"{name}: checkpoint shape {tuple(value.shape)} != model {tuple(param.shape)}")
                param.data = value.to(device=param.device, dtype=dtype)
    return missing, unexpected


def _reset_buffers(model: torch.nn.Module, device: torch.device | str) -> None:
    # Non-persistent buffers (rotary tables) were created on "meta"; rebuild them for real.
    for sub in model.modules():
        rebuild = getattr(sub, "rebuild_buffers", None)
        if rebuild is not None:
            rebuild(device)
