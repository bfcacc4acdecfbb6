"""ByteDance Seed-OSS: the Llama recipe with q/k/v biases (`attention_bias`) and the output
projection's own (`attention_out_bias`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs, DecoderLM


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    attention_out_bias: bool = False

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return replace(super().attention_recipe(layer_idx), o_bias=self.attention_out_bias)


class Model(DecoderLM):
    ARGS = ModelArgs
