"""The one-mixer block of the hybrids that give each layer a single job (Nemotron-H's pattern of
Mamba-2 `M`, attention `*`, MLP `-` and MoE `E` layers): x + mixer(norm(x)).

A `BlockRecipe` stands where a `decoder.LayerRecipe` does (DecoderModel builds either through its
`build`); its `attention` is the mixer recipe when the mixer takes positions and the step context
(attention, Mamba-2), None for a feed-forward layer (`mlp` or `feed_forward`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mlxcel.layers.decoder import MLP, MixerRecipe, MLPRecipe, NormRecipe, Rope


@dataclass(frozen=True)
class BlockRecipe:
    norm: NormRecipe
    attention: MixerRecipe | None = None
    mlp: MLPRecipe | None = None
    feed_forward: Callable[[], nn.Module] | None = None
    norm_name: str = "norm"
    mixer_name: str = "mixer"

    def build(self, hidden_size: int, layer_idx: int, rope: Rope | None, kv_index: int | None = None) -> nn.Module:
        return MixerBlock(hidden_size, self, layer_idx, rope, kv_index)


class MixerBlock(nn.Module):
    def __init__(self, hidden_size: int, recipe: BlockRecipe, layer_idx: int, rope: Rope | None,
                 kv_index: int | None = None) -> None:
        """`kv_index`: an attention mixer's index in the KV cache (decoder.DecoderLayer's); a recurrent
        mixer goes by `layer_idx`."""
        super().__init__()
        self.recipe, self.kv_index = recipe, kv_index
        self.native_layout = None  # the CPU's native decode step runs Llama-shaped layers only
        setattr(self, recipe.norm_name, recipe.norm.build(hidden_size))
        if recipe.attention is not None:
            index = kv_index if kv_index is not None else layer_idx
            mixer = recipe.attention.build(hidden_size, index, rope, recipe.norm)
        elif recipe.feed_forward is not None:
            mixer = recipe.feed_forward()
        else:
            mixer = MLP(hidden_size, recipe.mlp)
        setattr(self, recipe.mixer_name, mixer)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: object) -> torch.Tensor:
        h = getattr(self, self.recipe.norm_name)(x)
        mixer = getattr(self, self.recipe.mixer_name)
        if self.recipe.attention is not None:
            return x + mixer(h, positions, ctx)
        return x + mixer(h, ctx)
