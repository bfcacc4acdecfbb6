"""What the mixture-of-experts families share: their MoE layers over layers/moe.py."""

from __future__ import annotations

import re
from dataclasses import fields, replace
from functools import partial
from typing import Any

from mlxcel.layers.decoder import DecoderArgs, LayerRecipe
from mlxcel.layers.moe import MoE, MoESpec

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def config_of(args: DecoderArgs) -> dict[str, Any]:
    """The family's config as a dict again (its fields over the keys it keeps in `extra`), for
    `layers.moe.moe_spec_from_config`, which reads the usual HF MoE keys."""
    return {**args.extra, **{f.name: getattr(args, f.name) for f in fields(args) if f.name != "extra"}}


def moe_layer(recipe: LayerRecipe, spec: MoESpec, name: str = "mlp") -> LayerRecipe:
    """`recipe` with its dense MLP replaced by an MoE block at the checkpoint's module `name`."""
    return replace(recipe, mlp=None, feed_forward=partial(MoE, spec), mlp_name=name)


def is_sparse_layer(args: DecoderArgs, layer_idx: int) -> bool:
    """Qwen2-MoE / Qwen3-MoE: every `decoder_sparse_step`-th layer is MoE, unless `mlp_only_layers` names it."""
    config = config_of(args)
    step, dense = config.get("decoder_sparse_step") or 1, config.get("mlp_only_layers") or ()
    num_experts = config.get("num_experts") or config.get("num_local_experts") or 0  # transformers 5 saves the latter
    return layer_idx not in dense and num_experts > 0 and (layer_idx + 1) % step == 0


def decoder_layers_only(weights: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Without the layers past the last decoder layer: the MTP layers DeepSeek-V3 and GLM-4.5
    checkpoints carry (not served here)."""
    return {k: v for k, v in weights.items() if not (m := _LAYER.match(k)) or int(m.group(1)) < num_layers}
