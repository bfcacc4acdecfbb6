"""StarCoder 2: LayerNorms with biases, biases on every projection (`use_bias`), and a plain
(ungated) GELU MLP `c_fc` -> `c_proj`; optional sliding window on every layer."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mlxcel.layers.decoder import AttentionRecipe, DecoderArgs, DecoderLM, MLPRecipe, NormRecipe
from mlxcel.models._gguf import has_layer_tensor

if TYPE_CHECKING:
    from mlxcel.models._gguf import GGUFTensors


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    norm_epsilon: float = 1e-5
    use_bias: bool = True
    hidden_act: str = "gelu_pytorch_tanh"

    def norm_recipe(self) -> NormRecipe:
        return NormRecipe("layer", self.norm_epsilon, bias=True)

    def layer_window(self, layer_idx: int) -> int | None:
        return self.sliding_window or None

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        bias = self.use_bias
        return replace(super().attention_recipe(layer_idx), q_bias=bias, kv_bias=bias, o_bias=bias)

    def mlp_recipe(self, layer_idx: int) -> MLPRecipe:
        return MLPRecipe(self.intermediate_size, self.hidden_act, gated=False, bias=self.use_bias,
                         names=("c_fc", "c_proj"))


class Model(DecoderLM):
    ARGS = ModelArgs


GGUF_LAYER_NAMES = {"ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    """LayerNorm eps under its GGUF key; biases known by their tensors (the converter writes no window)."""
    return {**config, "norm_epsilon": config.get("layer_norm_eps", 1e-5),
            "use_bias": has_layer_tensor(gguf, "attn_q.bias")}
