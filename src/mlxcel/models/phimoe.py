"""Phi-3.5-MoE: LayerNorms with biases, optional attention and head biases, a window on every layer
when set, and an MoE block (`block_sparse_moe`) routed by Phi-MoE's top-2 sparsemixer; experts
stored per expert as Mixtral's w1 / w3 / w2."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from mlxcel.layers.decoder import DecoderArgs, NormRecipe
from mlxcel.models._moe import MoEArgs, MoEDecoderLM


@dataclass(frozen=True)
class ModelArgs(MoEArgs, DecoderArgs):
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    lm_head_bias: bool = False

    MOE_ROUTER = "sparsemixer"
    MOE_BLOCK = "block_sparse_moe"

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


class Model(MoEDecoderLM):
    ARGS = ModelArgs
    MOE_LAYOUT = "mixtral"

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        if args.lm_head_bias and not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=True)
