"""Gemma 3 text family: the shared decoder's Gemma recipe (Gemma3ForCausalLM's parameter names).

Differences from Llama: embeddings scaled by sqrt(hidden); (1 + w) RMSNorms, also on q and k
per head; norms before and after both attention and MLP; tanh-GELU MLP; a fixed query scale
(query_pre_attn_scalar); sliding-window layers with their own rope theta, interleaved with
global layers (which alone take the rope scaling).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from mlxcel.layers.decoder import (
    FULL, SLIDING, AttentionRecipe, DecoderArgs, DecoderLM, MLPRecipe, NormRecipe, RopeRecipe, activation,
)
from mlxcel.layers.rope import rope_settings
from mlxcel.models._gguf import unshift_norms

if TYPE_CHECKING:
    from collections.abc import Mapping

    from mlxcel.models._gguf import GGUFTensors

SANDWICH_NORMS = {"attn_in": "input_layernorm", "attn_out": "post_attention_layernorm",
                  "mlp_in": "pre_feedforward_layernorm", "mlp_out": "post_feedforward_layernorm"}


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    head_dim: int | None = 256
    rope_theta: float = 1_000_000.0  # global layers
    rope_local_base_freq: float = 10_000.0
    rope_local_scaling: dict[str, Any] | None = None
    query_pre_attn_scalar: float = 256.0
    sliding_window: int | None = 4096  # applies to the sliding layers only
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    hidden_activation: str = "gelu_pytorch_tanh"
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None

    NORM_NAMES: ClassVar[Mapping[str, str]] = SANDWICH_NORMS

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        _check_supported(config)
        return {**config, **_rope_fields(config), "layer_types": _layer_types(config),
                "hidden_activation": config.get("hidden_activation") or "gelu_pytorch_tanh"}

    @property
    def embed_scale(self) -> float:
        return self.hidden_size**0.5

    @property
    def final_softcap(self) -> float | None:
        return self.final_logit_softcapping

    def layer_rope(self, layer_idx: int) -> RopeRecipe:
        if self.is_sliding(layer_idx):
            return RopeRecipe.of(self.rope_local_base_freq, self.rope_local_scaling, self.dim_per_head)
        return RopeRecipe.of(self.rope_theta, self.rope_scaling, self.dim_per_head)

    def norm_recipe(self) -> NormRecipe:
        return NormRecipe("rms", self.rms_norm_eps, offset=1.0)

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return replace(super().attention_recipe(layer_idx), scale=float(self.query_pre_attn_scalar) ** -0.5,
                       qk_norm="head", softcap=self.attn_logit_softcapping)

    def mlp_recipe(self, layer_idx: int) -> MLPRecipe:
        return MLPRecipe(self.intermediate_size, self.hidden_activation)


def _check_supported(config: dict[str, Any]) -> None:
    if config.get("use_bidirectional_attention"):
        raise ValueError("gemma3: use_bidirectional_attention (an embedding model) is not supported")
    activation(config.get("hidden_activation") or "gelu_pytorch_tanh")


def _rope_fields(config: dict[str, Any]) -> dict[str, Any]:
    """Global and local rope from `rope_parameters` (keyed by layer type) or the older flat keys."""
    theta, scaling = rope_settings(config, FULL, default_theta=1_000_000.0)
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(SLIDING), dict):
        local_theta, local_scaling = rope_settings(config, SLIDING)
    else:
        local_theta, local_scaling = float(config.get("rope_local_base_freq") or 10_000.0), None
    return {"rope_theta": theta, "rope_scaling": scaling,
            "rope_local_base_freq": local_theta, "rope_local_scaling": local_scaling}


def _layer_types(config: dict[str, Any]) -> tuple[str, ...]:
    if config.get("layer_types"):
        return tuple(config["layer_types"])
    # Older configs give a pattern: every n-th layer is global, the rest slide.
    pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6)
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(config["num_hidden_layers"]))


class Model(DecoderLM):
    ARGS = ModelArgs

    @classmethod
    def sanitize(cls, weights: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        """Text weights only: multimodal checkpoints nest them under a language model prefix."""
        kept = {text: value for name, value in weights.items() if (text := _text_name(name)) is not None}
        return super().sanitize(kept, args)


# Prefixes of the text model inside Gemma3ForConditionalGeneration (transformers 4 and 5 layouts).
_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                  "language_model.lm_head.": "lm_head."}
_VISION_MARKERS = ("vision_tower.", "multi_modal_projector.")


def _text_name(name: str) -> str | None:
    if any(marker in name for marker in _VISION_MARKERS):
        return None
    for prefix, replacement in _TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name


# GGUF per-layer tensor names that differ from the Llama mapping.
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    """Settings llama.cpp fixes in code for gemma3 rather than storing them in the file: every 6th
    layer global unless the file gives a pattern, local rope theta 10000 unless `rope.freq_base_swa`."""
    config = {**config, "rope_local_base_freq": gguf.arch_value("rope.freq_base_swa", 10_000.0),
              "sliding_window_pattern": 6, "query_pre_attn_scalar": gemma_query_scalar(config, 62)}
    return config


def gemma_query_scalar(config: dict[str, Any], layers_of_27b: int) -> int:
    """llama.cpp: the 27B (by its layer count) scales queries by hidden/heads, every other size by head_dim."""
    if config["num_hidden_layers"] == layers_of_27b:
        return config["hidden_size"] // config["num_attention_heads"]
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


fix_gguf_weights = unshift_norms  # the converter stores (1 + w)
