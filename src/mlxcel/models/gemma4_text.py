"""Gemma 4 (text): the shared decoder's recipe for Gemma4ForCausalLM (transformers 5.25's `gemma4`).

Differences from Gemma 3 (models/gemma3.py):
- plain RMSNorms (x * w, not x * (1 + w)); values RMS-normed per head with no weight; q/k norms per head;
  no query scaling (scale 1.0);
- global (full-attention) layers with their own head size (`global_head_dim`, or transformers 5's
  `per_layer_config`) and KV-head count, and proportional rope (a quarter of the angles turn); with
  `attention_k_eq_v` their values are the keys' projection (no v_proj);
- KV sharing: the last `num_kv_shared_layers` layers compute no keys or values; each attends over those of the
  last earlier layer of its type, reading that layer's cache (it keeps none: engine KV is per KV layer);
- per-layer inputs (`hidden_size_per_layer_input`): a second embedding plus a projection of the first give
  each layer a small input, gated into the residual after the MLP (layers/decoder.py); every layer's output
  is multiplied by its learned `layer_scalar`;
- KV-shared layers may have a double-width MLP (`use_double_wide_mlp`).
- the MoE variant (`enable_moe_block`, e.g. 26B-A4B): each layer runs its dense MLP and its experts side by
  side, each branch with its own norms, the router reading the un-normed residual (`DenseAndExperts`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import nn

from mlxcel.layers.decoder import (
    FULL, MLP, SLIDING, AttentionRecipe, DecoderArgs, DecoderLM, LayerRecipe, MLPRecipe, NormRecipe, RopeRecipe,
)
from mlxcel.layers.moe import Experts, MoESpec, RouterSpec, route
from mlxcel.layers.norm import rms_normalize
from mlxcel.layers.quant import Step
from mlxcel.models import gemma3
from mlxcel.models._hybrid import rename_prefixes
from mlxcel.models.gemma3 import _check_supported, _rope_fields

__all__ = ["Model", "ModelArgs"]

log = logging.getLogger(__name__)

# transformers' defaults where a config leaves the rope out
_DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                 FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


@dataclass(frozen=True)
class ModelArgs(gemma3.ModelArgs):
    """Gemma 3's arguments (embedding scale, final soft-cap, sandwich norms, rope per layer type) and Gemma 4's."""

    head_dim: int | None = 256  # the sliding layers'; `layer_head_dims` has every layer's
    sliding_window: int | None = 512  # applies to the sliding layers only
    hidden_size_per_layer_input: int = 256
    vocab_size_per_layer_input: int = 262_144
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    enable_moe_block: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        _check_supported({**config, "use_bidirectional_attention": config.get("use_bidirectional_attention") == "all"})
        config = {**config, "layer_types": _layer_types(config)}
        if not config.get("rope_parameters") and config.get("rope_theta") is None:
            config["rope_parameters"] = _DEFAULT_ROPE
        heads, dims = _layer_shapes(config)
        return {**config, **_rope_fields(config), "layer_head_dims": dims, "layer_kv_heads": heads,
                "hidden_activation": config.get("hidden_activation") or "gelu_pytorch_tanh"}

    @property
    def per_layer_input_width(self) -> int:
        return self.hidden_size_per_layer_input or 0

    @property
    def kv_sources(self) -> tuple[int | None, ...]:
        """Each layer's KV source: None where it computes its own, else the last earlier layer of its type
        before the shared ones (transformers' `kv_sharing_modes`)."""
        first_shared = self.num_hidden_layers - self.num_kv_shared_layers
        types = self.layer_types or ()
        return tuple(None if i < first_shared else max(j for j in range(first_shared) if types[j] == types[i])
                     for i in range(self.num_hidden_layers))

    @property
    def kv_layer_shapes(self) -> tuple[tuple[int, int], ...]:
        """(KV heads, head size) of each layer that keeps KV, in order (engine/kv/tensors.py)."""
        return tuple((self.layer_kv_heads[i], self.layer_head_dims[i])
                     for i, source in enumerate(self.kv_sources) if source is None)

    def layer_rope(self, layer_idx: int) -> RopeRecipe:
        dim = self.layer_head_dims[layer_idx]
        if self.is_sliding(layer_idx):
            return RopeRecipe.of(self.rope_local_base_freq, self.rope_local_scaling, dim)
        return RopeRecipe.of(self.rope_theta, self.rope_scaling, dim)

    def norm_recipe(self) -> NormRecipe:
        return NormRecipe("rms", self.rms_norm_eps)

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return AttentionRecipe(
            self.num_attention_heads, self.layer_kv_heads[layer_idx], self.layer_head_dims[layer_idx], 1.0,
            self.layer_rope(layer_idx), self.layer_window(layer_idx), q_bias=self.attention_bias,
            kv_bias=self.attention_bias, o_bias=self.attention_bias, qk_norm="head", v_norm=True,
            values_are_keys=self.attention_k_eq_v and not self.is_sliding(layer_idx),
            kv_source=self.kv_sources[layer_idx], is_kv_reused=layer_idx in self.kv_sources)

    def layer_recipe(self, layer_idx: int) -> LayerRecipe:
        is_shared = self.kv_sources[layer_idx] is not None
        width = self.intermediate_size * (2 if self.use_double_wide_mlp and is_shared else 1)
        mlp = MLPRecipe(width, self.hidden_activation)
        recipe = LayerRecipe(self.attention_recipe(layer_idx), self.norm_recipe(), self.NORM_NAMES, mlp=mlp,
                             per_layer_input=self.per_layer_input_width, has_layer_scalar=True)
        if not self.enable_moe_block:
            return recipe
        # the block norms its own inputs (the router reads the residual as it is): no "mlp_in" slot
        norms = {slot: name for slot, name in self.NORM_NAMES.items() if slot != "mlp_in"}
        return replace(recipe, norm_names=norms, feed_forward=partial(DenseAndExperts, self, mlp))

    def moe_spec(self) -> MoESpec:
        router = RouterSpec("softmax", int(self.num_experts or 0), int(self.top_k_experts or 0), normalize=True)
        return MoESpec(router, self.hidden_size, int(self.moe_intermediate_size or 0), self.hidden_activation)


class Gemma4Router(nn.Module):
    """Gemma4TextRouter: the residual RMS-normed (no weight), times `scale` / sqrt(hidden), projected; softmax,
    top-k renormalised, each pick times its expert's `per_expert_scale`."""

    def __init__(self, spec: MoESpec, eps: float) -> None:
        super().__init__()
        self.spec, self.eps = spec.router, eps
        self.proj = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(spec.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(spec.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, expert ids [T, k])."""
        h = rms_normalize(x, self.eps) * self.scale * x.shape[-1] ** -0.5
        weights, ids = route(self.proj(h), self.spec)
        return weights * self.per_expert_scale[ids].float(), ids


class DenseAndExperts(MLP):
    """A Gemma 4 MoE layer's feed-forward, at the checkpoint's `mlp` (its dense MLP's names): the dense MLP
    over pre_feedforward_layernorm(x) normed by post_feedforward_layernorm_1, plus the experts over
    pre_feedforward_layernorm_2(x) normed by post_feedforward_layernorm_2 (those norms, `router` and `experts`
    sit at the layer in the checkpoint: `Model.sanitize` moves them here)."""

    def __init__(self, args: ModelArgs, mlp: MLPRecipe) -> None:
        super().__init__(args.hidden_size, mlp)
        spec, norm = args.moe_spec(), args.norm_recipe()
        for name in _MOE_NORMS:
            setattr(self, name, norm.build(args.hidden_size))
        self.router = Gemma4Router(spec, args.rms_norm_eps)
        self.experts = Experts(spec)

    def forward(self, x: torch.Tensor, ctx: Step | None = None) -> torch.Tensor:
        dense = self.post_feedforward_layernorm_1(super().forward(self.pre_feedforward_layernorm(x), ctx))
        weights, ids = self.router(x)
        experts = self.experts(self.pre_feedforward_layernorm_2(x), ids, weights)
        return dense + self.post_feedforward_layernorm_2(experts)


_MOE_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
              "post_feedforward_layernorm_2")
_MOE_MOVED = re.compile(r"^(model\.layers\.\d+\.)(router|experts|" + "|".join(_MOE_NORMS) + r")\.")


def _layer_types(config: dict[str, Any]) -> tuple[str, ...]:
    """The config's layer types (every 6th layer global where none are given); the last layer is always
    global, as transformers forces it."""
    count = int(config["num_hidden_layers"])
    types = list(config.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(count)])
    types[-1] = FULL
    return tuple(types)


def _layer_shapes(config: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each layer's KV heads and head size: the sliding layers' from `num_key_value_heads` / `head_dim`;
    the global layers' from transformers 5's `per_layer_config` (by layer index) or else `global_head_dim`
    (default 512) and, with attention_k_eq_v, `num_global_key_value_heads`."""
    heads, dim = int(config.get("num_key_value_heads") or config["num_attention_heads"]), int(config.get("head_dim") or 256)
    per_layer = {int(k): v for k, v in (config.get("per_layer_config") or {}).items()}
    if not per_layer:
        override: dict[str, Any] = {"head_dim": config.get("global_head_dim") or 512}
        if config.get("attention_k_eq_v") and config.get("num_global_key_value_heads"):
            override["num_key_value_heads"] = config["num_global_key_value_heads"]
        per_layer = {i: override for i, kind in enumerate(config["layer_types"]) if kind == FULL}
    count = int(config["num_hidden_layers"])
    return (tuple(int(per_layer.get(i, {}).get("num_key_value_heads") or heads) for i in range(count)),
            tuple(int(per_layer.get(i, {}).get("head_dim") or dim) for i in range(count)))


# A Gemma4ForConditionalGeneration checkpoint (model_type gemma4: its text_config is read as gemma4_text by
# loading/checkpoint.py): the text model's names, and the towers it is served without (text only for now).
_TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                  "language_model.lm_head.": "lm_head."}
_UNSERVED_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.",
                      "vision_tower.", "embed_vision.", "audio_tower.", "embed_audio.")


class Model(DecoderLM):
    ARGS = ModelArgs

    @classmethod
    def sanitize(cls, weights: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        """The text model's weights under our names. Hub checkpoints may still hold k/v projections and norms
        of the KV-shared layers, which never run; a multimodal checkpoint's towers are left out, said once."""
        assert isinstance(args, ModelArgs)
        unused = tuple(f"model.layers.{i}.self_attn.{part}." for i, source in enumerate(args.kv_sources)
                       if source is not None for part in ("k_proj", "v_proj", "k_norm", "v_norm"))
        towers = sorted({name.split(".")[1 if name.startswith("model.") else 0]
                         for name in weights if name.startswith(_UNSERVED_PREFIXES)})
        if towers:
            log.info("gemma4: serving text only: the checkpoint's %s (image and audio input) are not loaded; "
                     "requests with images get 400", ", ".join(towers))
        kept = rename_prefixes({k: v for k, v in weights.items() if not k.startswith(_UNSERVED_PREFIXES)},
                               _TEXT_PREFIXES)
        if args.enable_moe_block:  # the MoE block's parts, at the layer in the checkpoint, sit in our `mlp`
            kept = {_MOE_MOVED.sub(r"\1mlp.\2.", k): v for k, v in kept.items()}
        return super().sanitize({k: v for k, v in kept.items() if not k.startswith(unused)}, args)


# ---- GGUF, as llama.cpp's converter writes arch "gemma4" (conversion/gemma.py's Gemma4Model) ----

GGUF_LAYER_NAMES = {
    **gemma3.GGUF_LAYER_NAMES,
    "layer_output_scale": "layer_scalar",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
}
GGUF_GLOBAL_NAMES = {"per_layer_token_embd": "model.embed_tokens_per_layer",
                     "per_layer_model_proj": "model.per_layer_model_projection",
                     "per_layer_proj_norm": "model.per_layer_projection_norm"}


def gguf_config(config: dict[str, Any], gguf: Any) -> dict[str, Any]:
    """The converter's per-layer arrays and `_swa` keys as transformers' config: the global layers' head size
    (`key_length`) and KV heads (`head_count_kv`'s entry) in `per_layer_config`; the sliding layers'
    (`key_length_swa`); double-wide MLPs from `feed_forward_length`'s entries; the global layers' proportional
    rope from `rope_freqs` (1 where an angle turns, 1e30 where it does not); values = keys where the global
    layers store no attn_v."""
    if config.get("num_experts"):
        raise ValueError("gemma4: a mixture-of-experts GGUF (its router scales and expert stacks) is not supported "
                         "yet; the Hugging Face checkpoint is")
    count = int(config["num_hidden_layers"])
    types = config.get("layer_types") or [FULL] * count
    kv_heads, widths = (_per_layer(gguf.arch_value(key), count)
                        for key in ("attention.head_count_kv", "feed_forward_length"))
    full_dim = int(gguf.arch_value("attention.key_length"))
    swa_dim = int(gguf.arch_value("attention.key_length_swa", full_dim))
    shared = int(gguf.arch_value("attention.shared_kv_layers", 0) or 0)
    first_swa = types.index(SLIDING) if SLIDING in types else 0
    own_full = [i for i, kind in enumerate(types) if kind == FULL and i < count - shared]
    freqs = gguf.dequantize("rope_freqs.weight").reshape(-1) if "rope_freqs.weight" in gguf.tensors else None
    partial = float((freqs < 1e29).sum() * 2 / full_dim) if freqs is not None else 1.0
    swa_rotary = (gguf.arch_value("rope.dimension_count_swa") or swa_dim) / swa_dim
    return {**config, "layer_types": list(types), "head_dim": swa_dim, "num_key_value_heads": kv_heads[first_swa],
            "per_layer_config": {str(i): {"head_dim": full_dim, "num_key_value_heads": kv_heads[i]}
                                 for i, kind in enumerate(types) if kind == FULL},
            "attention_k_eq_v": bool(own_full) and not any(f"blk.{i}.attn_v.weight" in gguf.tensors for i in own_full),
            "num_kv_shared_layers": shared, "intermediate_size": widths[0],
            "use_double_wide_mlp": any(width == 2 * widths[0] for width in widths[count - shared:]),
            "hidden_size_per_layer_input": int(gguf.arch_value("embedding_length_per_layer_input", 0) or 0),
            "vocab_size_per_layer_input": _rows_of(gguf, "per_layer_token_embd.weight", config.get("vocab_size")),
            "rope_parameters": {
                FULL: {"rope_type": "proportional", "partial_rotary_factor": partial,
                       "rope_theta": float(gguf.arch_value("rope.freq_base", 1_000_000.0))},
                SLIDING: {"rope_type": "default", "rope_theta": float(gguf.arch_value("rope.freq_base_swa", 10_000.0)),
                          **({"partial_rotary_factor": swa_rotary} if swa_rotary != 1.0 else {})}}}


def _per_layer(value: Any, count: int) -> list[int]:
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)] * count


def _rows_of(gguf: Any, name: str, default: Any) -> Any:
    tensor = gguf.tensors.get(name)
    return int(tensor.shape[0]) if tensor is not None else default


def fix_gguf_weights(state: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The converter names the layer scalar `layer_output_scale.weight` (our `layer_scalar`)."""
    return {k[:-len(".weight")] if k.endswith(".layer_scalar.weight") else k: v for k, v in state.items()}
