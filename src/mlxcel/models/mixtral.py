"""Mixtral: the Mistral recipe with a sparse MoE block (`block_sparse_moe`) in every layer: softmax
router, top-k renormalised; experts stored per expert as w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlxcel.layers.decoder import DecoderArgs, DecoderLM, LayerRecipe
from mlxcel.layers.moe import moe_spec_from_config, sanitize_moe
from mlxcel.models import mistral
from mlxcel.models._moe import config_of, moe_layer


@dataclass(frozen=True)
class ModelArgs(mistral.ModelArgs):
    rope_theta: float = 1e6

    def layer_recipe(self, layer_idx: int) -> LayerRecipe:
        spec = moe_spec_from_config(config_of(self), "softmax", normalize=True)
        return moe_layer(super().layer_recipe(layer_idx), spec, "block_sparse_moe")


class Model(DecoderLM):
    ARGS = ModelArgs

    @classmethod
    def sanitize(cls, weights: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        return super().sanitize(sanitize_moe(weights, "mixtral"), args)
