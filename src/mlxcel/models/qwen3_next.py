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
                                   self.linear_value_head_dim, self.linear_conv_kernel_dim, self.rms_norm_eps)

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


GGUF_LAYER_NAMES = GGUF_MOE_NAMES


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    return {"norm_topk_prob": True, **config}
