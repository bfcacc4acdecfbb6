"""IBM Granite MoE (granite-3.x-*-a*): the Granite recipe (its four multipliers) with an MoE block
(`block_sparse_moe`): top-k of the router logits, softmax over those; experts stored stacked as
`input_linear` (gate and up) and `output_linear` (down), the router as `router.layer`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlxcel.layers.decoder import DecoderArgs, DecoderLM, LayerRecipe
from mlxcel.layers.moe import moe_spec_from_config, sanitize_moe
from mlxcel.models import granite
from mlxcel.models._moe import config_of, moe_layer


@dataclass(frozen=True)
class ModelArgs(granite.ModelArgs):
    def layer_recipe(self, layer_idx: int) -> LayerRecipe:
        spec = moe_spec_from_config(config_of(self), "topk_softmax")
        return moe_layer(super().layer_recipe(layer_idx), spec, "block_sparse_moe")


class Model(DecoderLM):
    ARGS = ModelArgs

    @classmethod
    def sanitize(cls, weights: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        return super().sanitize(sanitize_moe(weights, "granite"), args)
