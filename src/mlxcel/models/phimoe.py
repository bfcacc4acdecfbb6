"""Phi-3.5-MoE: LayerNorms with biases, optional attention and head biases, a window on every layer
when set, and an MoE block (`block_sparse_moe`) routed by Phi-MoE's top-2 sparsemixer; experts
stored per expert as Mixtral's w1 / w3 / w2."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mlxcel.layers.decoder import DecoderArgs, DecoderLM, LayerRecipe, NormRecipe
from mlxcel.layers.moe import moe_spec_from_config, sanitize_moe
from mlxcel.models._moe import config_of, moe_layer


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    lm_head_bias: bool = False

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = super().prepare(config)
        scaling = config.get("rope_scaling")
        if scaling and "short_mscale" in scaling:
            # Phi-MoE scales cos and sin by its own mscale (short and long equal in the released model).
            if scaling["short_mscale"] != scaling.get("long_mscale", scaling["short_mscale"]):
                raise ValueError("longrope with different short and long mscale is not supported")
            config["rope_scaling"] = {**scaling, "attention_factor": scaling["short_mscale"]}
        return config

    def norm_recipe(self) -> NormRecipe:
        return NormRecipe("layer", self.rms_norm_eps, bias=True)

    def layer_window(self, layer_idx: int) -> int | None:
        return self.sliding_window or None

    def layer_recipe(self, layer_idx: int) -> LayerRecipe:
        spec = moe_spec_from_config(config_of(self), "sparsemixer")
        return moe_layer(super().layer_recipe(layer_idx), spec, "block_sparse_moe")


class Model(DecoderLM):
    ARGS = ModelArgs

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        if args.lm_head_bias and not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=True)

    @classmethod
    def sanitize(cls, weights: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        return super().sanitize(sanitize_moe(weights, "mixtral"), args)
