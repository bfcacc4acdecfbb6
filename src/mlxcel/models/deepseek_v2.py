"""DeepSeek-V2 / V2-Lite / V2.5: DeepSeek-V3's shape (multi-head latent attention over the latent KV
cache, dense MLPs in the first `first_k_dense_replace` layers, routed plus shared experts in the
rest), with V2's router: softmax scores, chosen greedily or within the best `topk_group` groups
(`topk_method` "group_limited_greedy", a group scored by its best expert), not renormalised, times
`routed_scaling_factor` (transformers 5.25's DeepseekV2TopkRouter). Its rope always pairs neighbours."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxcel.layers.moe import MoESpec, moe_spec_from_config
from mlxcel.models import deepseek_v3
from mlxcel.models._moe import config_of

GGUF_LAYER_NAMES = deepseek_v3.GGUF_LAYER_NAMES  # llama.cpp's deepseek2 (deepseek_v3.gguf_config picks the family)


@dataclass(frozen=True)
class ModelArgs(deepseek_v3.ModelArgs):
    first_k_dense_replace: int = 0
    n_routed_experts: int | None = 64
    moe_intermediate_size: int = 1407
    q_lora_rank: int | None = 1536

    MOE_ROUTER = "softmax_grouped"

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        return super().prepare({**config, "rope_interleave": True})

    def moe_spec(self) -> MoESpec:
        config = config_of(self)
        if config.get("topk_method", "greedy") == "greedy":  # one group: every expert a candidate
            config = {**config, "n_group": 1, "topk_group": 1}
        return moe_spec_from_config(config, self.MOE_ROUTER, normalize=False)


class Model(deepseek_v3.Model):
    ARGS = ModelArgs
