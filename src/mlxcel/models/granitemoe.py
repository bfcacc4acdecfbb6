"""IBM Granite MoE (granite-3.x-*-a*): the Granite recipe (its four multipliers) with an MoE block
(`block_sparse_moe`): top-k of the router logits, softmax over those; experts stored stacked as
`input_linear` (gate and up) and `output_linear` (down), the router as `router.layer`."""

from __future__ import annotations

from dataclasses import dataclass

from mlxcel.models import granite
from mlxcel.models._moe import GGUF_MOE_NAMES, MoEArgs, MoEDecoderLM

# llama.cpp's granitemoe: Granite's metadata and permuted q/k, the MoE stacks under our block's name.
GGUF_LAYER_NAMES = {part: name.replace("mlp.", "block_sparse_moe.", 1) for part, name in GGUF_MOE_NAMES.items()}
gguf_config = granite.gguf_config
fix_gguf_weights = granite.fix_gguf_weights


@dataclass(frozen=True)
class ModelArgs(MoEArgs, granite.ModelArgs):
    MOE_ROUTER = "topk_softmax"
    MOE_BLOCK = "block_sparse_moe"


class Model(MoEDecoderLM):
    ARGS = ModelArgs
    MOE_LAYOUT = "granite"
