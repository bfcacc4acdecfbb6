"""TII Falcon-H1: every layer runs attention (`self_attn`, rope) and Mamba-2 (`mamba`) side by side
on the same normed input and adds both to the residual, then the SwiGLU MLP (`feed_forward`);
norms `input_layernorm`, `pre_ff_layernorm`, the final `final_layernorm`.

Its muP multipliers are scalars on linear maps, so they are folded into the weights they scale
when the checkpoint is read (as llama.cpp's converter does): `attention_in_multiplier` into q/k/v,
`key_multiplier` into k, `attention_out_multiplier` into o_proj, `ssm_in_multiplier` and the
per-part `ssm_multipliers` (z, x, B, C, dt) into the Mamba in_proj, `ssm_out_multiplier` into its
out_proj, `mlp_multipliers` into gate_proj and down_proj; the embedding and lm_head multipliers
are the embedding scale and logit scale."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from mlxcel.layers.decoder import DecoderArgs, DecoderLM, LayerRecipe
from mlxcel.layers.mamba2 import Mamba2Recipe
from mlxcel.models._hybrid import (fix_mamba2_weights, mamba2_gguf_names, mamba2_gguf_shape, rename_prefixes,
                                   time_step_limit)

if TYPE_CHECKING:
    from mlxcel.models._gguf import GGUFTensors


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    mamba_d_ssm: int | None = None
    mamba_expand: int = 2
    mamba_n_heads: int = 128
    mamba_d_head: int = 8
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_conv: int = 4
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_norm_before_gate: bool = True
    mamba_rms_norm: bool = False
    projectors_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    key_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_multipliers: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)

    NORM_NAMES = {"attn_in": "input_layernorm", "mlp_in": "pre_ff_layernorm"}

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = super().prepare(config)
        return {**config, "time_step_limit": time_step_limit(config),
                "ssm_multipliers": tuple(config.get("ssm_multipliers") or cls.ssm_multipliers),
                "mlp_multipliers": tuple(config.get("mlp_multipliers") or cls.mlp_multipliers)}

    @property
    def embed_scale(self) -> float | None:
        return self.embedding_multiplier if self.embedding_multiplier != 1.0 else None

    @property
    def logit_scale(self) -> float | None:
        return self.lm_head_multiplier if self.lm_head_multiplier != 1.0 else None

    @property
    def mamba_inner(self) -> int:
        return self.mamba_d_ssm or self.mamba_expand * self.hidden_size

    def mamba_recipe(self) -> Mamba2Recipe:
        return Mamba2Recipe(self.mamba_n_heads, self.mamba_inner // self.mamba_n_heads, self.mamba_d_state,
                            self.mamba_n_groups, self.mamba_d_conv, self.mamba_chunk_size, self.rms_norm_eps,
                            proj_bias=self.mamba_proj_bias, conv_bias=self.mamba_conv_bias,
                            out_bias=self.projectors_bias, dt_limit=self.time_step_limit,
                            has_norm=self.mamba_rms_norm, norm_before_gate=self.mamba_norm_before_gate)

    def layer_recipe(self, layer_idx: int) -> LayerRecipe:
        return replace(super().layer_recipe(layer_idx), side_mixer=self.mamba_recipe(), side_mixer_name="mamba",
                       mlp_name="feed_forward")

    def row_multipliers(self) -> torch.Tensor:
        """The Mamba in_proj's per-row multipliers: z, x, B, C, dt parts."""
        groups = self.mamba_n_groups * self.mamba_d_state
        sizes = (self.mamba_inner, self.mamba_inner, groups, groups, self.mamba_n_heads)
        return torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, self.ssm_multipliers)])

    def folded_scales(self) -> dict[str, tuple[Any, bool]]:
        """Checkpoint name (after `model.layers.N.`) -> (its factor: a scalar or one a row, whether the bias takes it)."""
        attn_in, gate, down = self.attention_in_multiplier, *self.mlp_multipliers
        return {
            "self_attn.q_proj": (attn_in, False), "self_attn.v_proj": (attn_in, False),
            "self_attn.k_proj": (attn_in * self.key_multiplier, False),
            "self_attn.o_proj": (self.attention_out_multiplier, True),
            "mamba.in_proj": (self.row_multipliers() * self.ssm_in_multiplier, False),
            "mamba.out_proj": (self.ssm_out_multiplier, True),
            "feed_forward.gate_proj": (gate, True), "feed_forward.down_proj": (down, True),
        }


class Model(DecoderLM):
    ARGS = ModelArgs

    @classmethod
    def sanitize(cls, weights: dict[str, Any], args: DecoderArgs) -> dict[str, Any]:
        weights = rename_prefixes(weights, {"model.final_layernorm.": "model.norm."})
        return super().sanitize(fold_multipliers(weights, args), args)  # type: ignore[arg-type]


def fold_multipliers(weights: dict[str, Any], args: ModelArgs) -> dict[str, Any]:
    """Each scaled linear's weight (rows times their factors) and, where the scale follows the bias, its bias."""
    scales = args.folded_scales()
    k_bias_scale = args.key_multiplier  # k_proj(x * m_in) * m_key: the bias takes only the key multiplier
    row_scale = args.row_multipliers()
    out = {}
    for key, value in weights.items():
        stem, _, kind = key.rpartition(".")
        module = stem.split(".", 3)[-1] if stem.startswith("model.layers.") else ""
        if module not in scales:
            out[key] = value
            continue
        factor, scales_bias = scales[module]
        if kind == "bias" and not scales_bias:
            factor = k_bias_scale if module == "self_attn.k_proj" else row_scale if module == "mamba.in_proj" else 1.0
        out[key] = _scaled(value, factor)
    return out


def _scaled(value: Any, factor: Any) -> Any:
    """A tensor (or a lazy reader's tensor) times `factor`: a scalar, or one a row ([rows] float32)."""
    if isinstance(factor, float) and factor == 1.0:
        return value

    def scale(t: torch.Tensor) -> torch.Tensor:
        f = factor.to(t.dtype).view(-1, *([1] * (t.dim() - 1))) if isinstance(factor, torch.Tensor) else factor
        return t * f

    if isinstance(value, torch.Tensor):
        return scale(value)
    reader: Callable[[str], torch.Tensor] = value
    return lambda name: scale(reader(name))


# ---- GGUF (issue 41): llama.cpp's falcon-h1 ------------------------------------------------------------
# The converter folds every muP multiplier into the weights (the embedding's and lm_head's too), so the
# file loads with all of them 1; llama.cpp's Mamba-2 gates before its grouped norm.

# llama.cpp names Falcon-H1's pre-FFN norm bare (`blk.N.ffn_norm`, no `.weight`)
GGUF_LAYER_NAMES = {**mamba2_gguf_names("mamba"), "ffn_norm": "pre_ff_layernorm.weight", "ffn_gate": "feed_forward.gate_proj",
                    "ffn_up": "feed_forward.up_proj", "ffn_down": "feed_forward.down_proj"}


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    mamba = mamba2_gguf_shape(gguf)
    return {**config, "mamba_d_ssm": mamba["inner_size"], "mamba_n_heads": mamba["num_heads"],
            "mamba_d_head": mamba["head_dim"], "mamba_d_state": mamba["state_size"],
            "mamba_n_groups": mamba["n_groups"], "mamba_d_conv": mamba["conv_kernel"],
            "mamba_conv_bias": mamba["conv_bias"], "mamba_proj_bias": mamba["proj_bias"],
            "mamba_rms_norm": "blk.0.ssm_norm.weight" in gguf.tensors, "mamba_norm_before_gate": False,
            "projectors_bias": "blk.0.ssm_out.bias" in gguf.tensors,
            "attention_bias": "blk.0.attn_q.bias" in gguf.tensors, "mlp_bias": "blk.0.ffn_up.bias" in gguf.tensors}


def fix_gguf_weights(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    return fix_mamba2_weights(state, "mamba")
