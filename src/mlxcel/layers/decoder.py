"""The decoder every text family is assembled from (DESIGN rule 2).

A family differs from its neighbours in a handful of choices: norm kind and placement, q/k
norms, biases, rope (theta, scaling, partial, interleaved), sliding windows, score soft-capping
or sinks, MLP activation, MoE, and a few scalar multipliers. Those choices are `LayerRecipe`
fields; a family module is a config reader (`DecoderArgs` subclass: `from_dict`, `layer_recipe`)
over the blocks here. Parameter names stay the checkpoint's: each recipe names the modules it
creates (`norm_names`, `MLPRecipe.names`, `mlp_name`), so a state dict loads as saved.

    x -> embed (* embed_scale)
      -> per layer: h = attn_in(x); a = attn_out(attention(h)); x += a * m
                    h = mlp_in(x);  f = mlp_out(mlp(h));      x += f * m      (m: residual multiplier)
         or, parallel (Cohere): x += attention(h) + mlp(h) with the one norm h = attn_in(x)
      -> final norm -> head (* logit_scale, soft-cap)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mlxcel.layers.attention import PLAIN, AttentionContext, ScoreRule
from mlxcel.layers.norm import LayerNorm, RMSNorm, rms_normalize
from mlxcel.layers.quant import GATE_UP, QKV, linear, project
from mlxcel.layers.rope import RotaryEmbedding, apply_rope, rope_settings, rotary_table

SLIDING, FULL = "sliding_attention", "full_attention"

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),  # CLIP's vision towers (LLaVA)
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


# ---- recipes ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class NormRecipe:
    """RMSNorm (`offset` 1.0: Gemma's x * (1 + w)) or LayerNorm (with or without a bias)."""

    kind: str = "rms"  # "rms" | "layer"
    eps: float = 1e-6
    offset: float = 0.0
    bias: bool = False

    def build(self, dim: int) -> nn.Module:
        if self.kind == "layer":
            return LayerNorm(dim, self.eps, bias=self.bias)
        return RMSNorm(dim, self.eps, offset=self.offset)


@dataclass(frozen=True)
class RopeRecipe:
    """Rotary embedding of a layer: theta and scaling, over the first `dim` of each head
    (partial rotary), halves rotated (HF's default) or neighbours paired (`interleaved`: GLM, Cohere)."""

    theta: float
    scaling: tuple[tuple[str, Any], ...] | None = None  # a hashable copy of the scaling dict
    dim: int = 0
    interleaved: bool = False

    @staticmethod
    def of(theta: float, scaling: Mapping[str, Any] | None, dim: int, *, interleaved: bool = False) -> RopeRecipe:
        frozen = tuple(sorted((k, json.dumps(v)) for k, v in scaling.items())) if scaling else None
        return RopeRecipe(float(theta), frozen, dim, interleaved)

    def scaling_dict(self) -> dict[str, Any] | None:
        return {k: json.loads(v) for k, v in self.scaling} if self.scaling else None


@dataclass(frozen=True)
class AttentionRecipe:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    rope: RopeRecipe | None  # None: a no-rope layer (SmolLM3, Cohere 2's global layers)
    window: int | None = None
    q_bias: bool = False
    kv_bias: bool = False
    o_bias: bool = False
    # "head": per head before rope (Qwen3, Gemma 3); "head_after_rope" (Hunyuan); "full": over the whole
    # projection (OLMo 2)
    qk_norm: str | None = None
    qk_norm_names: tuple[str, str] = ("q_norm", "k_norm")
    softcap: float | None = None
    has_sinks: bool = False  # gpt-oss: `self_attn.sinks` [num_heads]
    o_name: str = "o_proj"  # LFM2: out_proj
    # Qwen3-Next / Qwen3.5: q_proj also gives a gate a head ([q, gate] per head); out * sigmoid(gate)
    output_gate: bool = False
    v_norm: bool = False  # Gemma 4: values RMS-normalised per head, with no weight
    values_are_keys: bool = False  # Gemma 4's attention_k_eq_v: no v_proj, the values are k_proj's output
    # Gemma 4's KV sharing: this layer computes no keys or values and attends over those of layer
    # `kv_source` (an earlier layer, whose cache it reads: it keeps none of its own)
    kv_source: int | None = None
    is_kv_reused: bool = False  # a later layer reads this layer's keys and values (its `kv_source`)

    @property
    def has_kv(self) -> bool:
        return self.kv_source is None

    def build(self, hidden_size: int, layer_idx: int, rope: Rope | None, norm: NormRecipe) -> nn.Module:
        return Attention(hidden_size, self, layer_idx, rope, norm)


class MixerRecipe(Protocol):
    """What a layer's attention recipe gives the layer: its rope (shared tables are built per distinct
    rope), the width the rope turns, and the module. `AttentionRecipe` here; MLA's in layers/mla.py."""

    @property
    def rope(self) -> RopeRecipe | None: ...

    @property
    def head_dim(self) -> int: ...

    def build(self, hidden_size: int, layer_idx: int, rope: Rope | None, norm: NormRecipe) -> nn.Module: ...


@dataclass(frozen=True)
class MLPRecipe:
    """Gated (act(gate) * up -> down) or plain (act(up) -> down); `names` are the checkpoint's."""

    width: int
    activation: str = "silu"
    gated: bool = True
    bias: bool = False
    names: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LayerRecipe:
    """One decoder layer: attention, feed-forward and where the norms sit.

    `norm_names` maps the four norm slots (`attn_in`, `attn_out`, `mlp_in`, `mlp_out`) to the
    checkpoint's module names; a slot left out has no norm. `feed_forward` builds the MoE of a
    MoE layer (any module with `forward(x, ctx)`); `mlp` the dense MLP otherwise."""

    attention: MixerRecipe
    norm: NormRecipe
    norm_names: Mapping[str, str]
    mlp: MLPRecipe | None = None
    feed_forward: Callable[[], nn.Module] | None = None
    mlp_name: str = "mlp"
    parallel: bool = False
    residual_multiplier: float = 1.0
    attention_name: str = "self_attn"  # the mixer's checkpoint name (Qwen3.5's recurrent layers: linear_attn)
    # Falcon-H1: a second mixer beside the first over the same normed input, the two outputs summed
    side_mixer: MixerRecipe | None = None
    side_mixer_name: str = "mamba"
    # Gemma 4: the width of this layer's per-layer input (see DecoderModel's `per_layer_inputs`), added
    # after the MLP as x += norm(proj(act(gate(x)) * input)); 0: none
    per_layer_input: int = 0
    has_layer_scalar: bool = False  # Gemma 4: the layer's output (residual included) times a learned scalar

    def build(self, hidden_size: int, layer_idx: int, rope: Rope | None, kv_index: int | None = None) -> nn.Module:
        return DecoderLayer(hidden_size, self, layer_idx, rope, kv_index)

    @property
    def is_llama_layout(self) -> bool:
        """What the CPU's native decode step computes (engine/native_step.py): pre-norm plain RMSNorm,
        plain full rotary, SiLU-gated MLP without biases, no score rule, head_dim ** -0.5 scale."""
        att, mlp = self.attention, self.mlp
        if not isinstance(att, AttentionRecipe):
            return False
        return (dict(self.norm_names) == {"attn_in": "input_layernorm", "mlp_in": "post_attention_layernorm"}
                and self.norm.kind == "rms" and self.norm.offset == 0.0 and not self.parallel
                and self.residual_multiplier == 1.0 and att.qk_norm is None and att.softcap is None
                and not att.has_sinks and not att.output_gate and not att.o_bias and att.rope is not None
                and att.rope.dim == att.head_dim and not att.rope.interleaved
                and att.scale == att.head_dim**-0.5 and self.feed_forward is None and mlp is not None
                and mlp.gated and mlp.activation in ("silu", "swish") and not mlp.bias
                and mlp.names == ("gate_proj", "up_proj", "down_proj") and self.mlp_name == "mlp"
                and self.attention_name == "self_attn" and att.o_name == "o_proj" and self.side_mixer is None
                and not att.v_norm and not att.values_are_keys and att.kv_source is None and not att.is_kv_reused
                and not self.per_layer_input and not self.has_layer_scalar)


# ---- blocks -----------------------------------------------------------------------------------

class Rope:
    """A shared RotaryEmbedding applied as a layer's recipe says (partial, interleaved)."""

    def __init__(self, table: RotaryEmbedding, recipe: RopeRecipe, head_dim: int) -> None:
        self.table, self.dim, self.head_dim = table, recipe.dim, head_dim
        self.interleaved = recipe.interleaved

    def __call__(self, q: torch.Tensor, k: torch.Tensor | None,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q, k turned (k None: a layer that reuses another's keys turns its queries only)."""
        cos, sin = self.table.cos_sin(positions, q.dtype)
        return self._turn(q, cos, sin), None if k is None else self._turn(k, cos, sin)

    def _turn(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotated = x if self.dim == self.head_dim else x[..., :self.dim]
        if self.interleaved:
            # Pairs (2i, 2i+1) become halves (i, dim/2 + i). The same permutation of q's and k's
            # dimensions leaves every q.k score as it was, so it is not undone.
            rotated = torch.cat((rotated[..., 0::2], rotated[..., 1::2]), dim=-1)
        rotated = apply_rope(rotated, cos, sin)
        return rotated if self.dim == self.head_dim else torch.cat((rotated, x[..., self.dim:]), dim=-1)


class Attention(nn.Module):
    """Self-attention over the paged cache: GQA/MQA, biases, q/k norms, rope, window, score rule."""

    def __init__(self, hidden_size: int, recipe: AttentionRecipe, layer_idx: int, rope: Rope | None,
                 norm: NormRecipe) -> None:
        super().__init__()
        r = recipe
        self.layer_idx, self.recipe = layer_idx, r
        self.num_heads, self.num_kv_heads, self.head_dim = r.num_heads, r.num_kv_heads, r.head_dim
        self.scale, self.window = r.scale, r.window
        q_out, kv_out = r.num_heads * r.head_dim, r.num_kv_heads * r.head_dim
        self.q_proj = nn.Linear(hidden_size, q_out * (2 if r.output_gate else 1), bias=r.q_bias)
        if r.has_kv:
            self.k_proj = nn.Linear(hidden_size, kv_out, bias=r.kv_bias)
        if r.has_kv and not r.values_are_keys:
            self.v_proj = nn.Linear(hidden_size, kv_out, bias=r.kv_bias)
        setattr(self, r.o_name, nn.Linear(q_out, hidden_size, bias=r.o_bias))
        if r.qk_norm is not None:
            q_dim, k_dim = (q_out, kv_out) if r.qk_norm == "full" else (r.head_dim, r.head_dim)
            setattr(self, r.qk_norm_names[0], norm.build(q_dim))
            if r.has_kv:
                setattr(self, r.qk_norm_names[1], norm.build(k_dim))
        if r.has_sinks:
            self.sinks = nn.Parameter(torch.zeros(r.num_heads))
        self.rope = [rope] if rope is not None else []  # a list keeps the shared table out of the parameters

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        t, r = x.shape[0], self.recipe
        if r.v_norm or not r.has_kv or r.values_are_keys:
            return self._forward_normed_values(x, positions, ctx)
        q, k, v = project(self, x, QKV, ctx)
        gate = None
        if r.output_gate:  # [T, H, 2D]: each head's query, then its gate
            q, gate = q.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(t, -1), gate.reshape(t, -1)
        if r.qk_norm == "full":
            q, k = getattr(self, r.qk_norm_names[0])(q), getattr(self, r.qk_norm_names[1])(k)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if r.qk_norm == "head":
            q, k = getattr(self, r.qk_norm_names[0])(q), getattr(self, r.qk_norm_names[1])(k)
        if self.rope:
            q, k = self.rope[0](q, k, positions)
        if r.qk_norm == "head_after_rope":
            q, k = getattr(self, r.qk_norm_names[0])(q), getattr(self, r.qk_norm_names[1])(k)
        out = ctx.attend(self.layer_idx, q, k, v, scale=self.scale, window=self.window, rule=self._rule())
        out = out.reshape(t, -1)
        return linear(getattr(self, r.o_name), out * torch.sigmoid(gate) if gate is not None else out, ctx)

    def _forward_normed_values(self, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """Gemma 4's attention: q/k norms per head, values normed without a weight (`v_norm`); values that
        are the keys' projection (`values_are_keys`), or no keys and values at all (a KV-shared layer,
        which attends over its source layer's cache: `ctx.attend` with k = v = None)."""
        t, r = x.shape[0], self.recipe
        q_norm = getattr(self, r.qk_norm_names[0])
        q = q_norm(linear(self.q_proj, x, ctx).view(t, self.num_heads, self.head_dim))
        k = v = None
        if r.has_kv:
            k, v = project(self, x, ("k_proj", "v_proj"), ctx) if hasattr(self, "v_proj") else (
                linear(self.k_proj, x, ctx), None)
            k = k.view(t, self.num_kv_heads, self.head_dim)
            v = k if v is None else v.view(t, self.num_kv_heads, self.head_dim)
            v = rms_normalize(v, q_norm.eps) if r.v_norm else v
            k = getattr(self, r.qk_norm_names[1])(k)
        if self.rope:
            q, k = self.rope[0](q, k, positions)
        out = ctx.attend(self.layer_idx, q, k, v, scale=self.scale, window=self.window, rule=self._rule(),
                         is_reused=r.is_kv_reused)
        return linear(getattr(self, r.o_name), out.reshape(t, -1), ctx)

    def _rule(self) -> ScoreRule:
        if self.recipe.softcap is None and not self.recipe.has_sinks:
            return PLAIN
        return ScoreRule(self.recipe.softcap, self.sinks if self.recipe.has_sinks else None)


class MLP(nn.Module):
    """Gated or plain feed-forward with the checkpoint's projection names."""

    def __init__(self, hidden_size: int, recipe: MLPRecipe) -> None:
        super().__init__()
        self.recipe, self.act = recipe, activation(recipe.activation)
        *inputs, down = recipe.names
        for name in inputs:
            setattr(self, name, nn.Linear(hidden_size, recipe.width, bias=recipe.bias))
        setattr(self, down, nn.Linear(recipe.width, hidden_size, bias=recipe.bias))

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        *inputs, down = self.recipe.names
        if self.recipe.gated:
            gate, up = project(self, x, GATE_UP, ctx) if tuple(inputs) == GATE_UP else (
                linear(getattr(self, inputs[0]), x, ctx), linear(getattr(self, inputs[1]), x, ctx))
            return linear(getattr(self, down), self.act(gate) * up, ctx)
        return linear(getattr(self, down), self.act(linear(getattr(self, inputs[0]), x, ctx)), ctx)


class DecoderLayer(nn.Module):
    def __init__(self, hidden_size: int, recipe: LayerRecipe, layer_idx: int, rope: Rope | None,
                 kv_index: int | None = None) -> None:
        """`kv_index`: the layer's index in the KV cache (its count among the layers that keep keys and values:
        a hybrid's recurrent layers keep none, issue 41); None for a recurrent layer, which goes by `layer_idx`."""
        super().__init__()
        self.recipe = recipe
        self.kv_index = kv_index
        mixer_index = kv_index if kv_index is not None else layer_idx
        setattr(self, recipe.attention_name, recipe.attention.build(hidden_size, mixer_index, rope, recipe.norm))
        if recipe.side_mixer is not None:  # a recurrent mixer: by its layer index
            setattr(self, recipe.side_mixer_name, recipe.side_mixer.build(hidden_size, layer_idx, None, recipe.norm))
        ffn = recipe.feed_forward() if recipe.feed_forward is not None else MLP(hidden_size, recipe.mlp)
        setattr(self, recipe.mlp_name, ffn)
        for name in recipe.norm_names.values():
            setattr(self, name, recipe.norm.build(hidden_size))
        self.hidden_size = hidden_size
        if recipe.per_layer_input:
            self.per_layer_input_gate = nn.Linear(hidden_size, recipe.per_layer_input, bias=False)
            self.per_layer_projection = nn.Linear(recipe.per_layer_input, hidden_size, bias=False)
            self.post_per_layer_input_norm = recipe.norm.build(hidden_size)
            self.act = activation(recipe.mlp.activation if recipe.mlp is not None else "gelu_pytorch_tanh")
        if recipe.has_layer_scalar:
            self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        # The CPU's native decode step may run this layer (engine/native_step.py).
        self.native_layout = "llama" if recipe.is_llama_layout else None

    def _norm(self, slot: str, x: torch.Tensor) -> torch.Tensor:
        name = self.recipe.norm_names.get(slot)
        return getattr(self, name)(x) if name is not None else x

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        r = self.recipe
        if not r.per_layer_input:
            x = self._residual_stream(x, positions, ctx)
            return x * self.layer_scalar if r.has_layer_scalar else x
        # [T, hidden | the per-layer inputs of this layer and the next ones]: this layer takes the first
        # width and rotates it to the end, so every layer finds its own first (DecoderModel.embed)
        h, inputs = x[:, :self.hidden_size], x[:, self.hidden_size:]
        h = self._residual_stream(h, positions, ctx)
        own = inputs[:, :r.per_layer_input]
        g = self.per_layer_projection(self.act(self.per_layer_input_gate(h)) * own)
        h = h + self.post_per_layer_input_norm(g)
        if r.has_layer_scalar:
            h = h * self.layer_scalar
        return torch.cat((h, inputs[:, r.per_layer_input:], own), dim=-1)

    def _residual_stream(self, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        r, ffn = self.recipe, getattr(self, self.recipe.mlp_name)
        mixer = getattr(self, r.attention_name)
        h = self._norm("attn_in", x)
        if r.parallel:
            return x + (mixer(h, positions, ctx) + ffn(h, ctx))
        a = mixer(h, positions, ctx)
        if r.side_mixer is not None:
            a = a + getattr(self, r.side_mixer_name)(h, positions, ctx)
        a = self._norm("attn_out", a)
        x = x + (a * r.residual_multiplier if r.residual_multiplier != 1.0 else a)
        f = self._norm("mlp_out", ffn(self._norm("mlp_in", x), ctx))
        return x + (f * r.residual_multiplier if r.residual_multiplier != 1.0 else f)


# ---- the family's arguments ---------------------------------------------------------------------

@dataclass(frozen=True)
class DecoderArgs:
    """The HF config fields most families share; a family subclasses it, changes defaults, adds its
    own fields and says how each layer is built (`layer_recipe`). Unknown config keys go to `extra`."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    # What the layers' norms are and where they sit; families override.
    NORM_NAMES: ClassVar[Mapping[str, str]] = {"attn_in": "input_layernorm", "mlp_in": "post_attention_layernorm"}

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> DecoderArgs:
        config = cls.prepare(dict(config))
        names = {f.name for f in fields(cls)}
        known = {k: v for k, v in config.items() if k in names and k != "extra"}
        if known.get("layer_types") is not None:
            known["layer_types"] = tuple(known["layer_types"])
        return cls(**known, extra={k: v for k, v in config.items() if k not in names})

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The config as this family reads it (rope in either form; families add their own fixes)."""
        theta, scaling = rope_settings(config, default_theta=cls.rope_theta)
        return {**config, "rope_theta": theta, "rope_scaling": scaling}

    @property
    def num_kv_layers(self) -> int:
        """Layers whose keys and values the KV cache holds (a hybrid's recurrent layers hold none)."""
        return sum(getattr(self.layer_recipe(i).attention, "has_kv", True) for i in range(self.num_hidden_layers))

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def per_layer_input_width(self) -> int:
        """Gemma 4: the width of each layer's per-layer input (DecoderModel.embed); 0: none."""
        return 0

    @property
    def kv_values_are_keys(self) -> bool:
        """The layers attend with their keys as values (MLA), so the KV cache stores keys only."""
        return False

    @property
    def embed_scale(self) -> float | None:
        return None

    @property
    def logit_scale(self) -> float | None:
        """Logits are multiplied by this (Cohere's logit_scale, 1 / Granite's logits_scaling)."""
        return None

    @property
    def final_softcap(self) -> float | None:
        return None

    def is_sliding(self, layer_idx: int) -> bool:
        return self.layer_types is not None and self.layer_types[layer_idx] == SLIDING

    def layer_window(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.sliding_window and self.is_sliding(layer_idx) else None

    def layer_rope(self, layer_idx: int) -> RopeRecipe | None:
        return RopeRecipe.of(self.rope_theta, self.rope_scaling, int(self.dim_per_head * self.partial_rotary_factor))

    def norm_recipe(self) -> NormRecipe:
        return NormRecipe("rms", self.rms_norm_eps)

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return AttentionRecipe(
            self.num_attention_heads, self.kv_heads, self.dim_per_head, self.dim_per_head**-0.5,
            self.layer_rope(layer_idx), self.layer_window(layer_idx),
            q_bias=self.attention_bias, kv_bias=self.attention_bias, o_bias=self.attention_bias)

    def mlp_recipe(self, layer_idx: int) -> MLPRecipe:
        return MLPRecipe(self.intermediate_size, self.hidden_act, bias=self.mlp_bias)

    def layer_recipe(self, layer_idx: int) -> LayerRecipe:
        return LayerRecipe(self.attention_recipe(layer_idx), self.norm_recipe(), self.NORM_NAMES,
                           mlp=self.mlp_recipe(layer_idx))


# ---- the model --------------------------------------------------------------------------------

@dataclass(frozen=True)
class EmbeddingOverride:
    """Input embeddings that replace the token embeddings of some rows of a step (issue 43): the
    vision encoder's output at image placeholder positions. rows: [n] long, values: [n, hidden]."""

    rows: torch.Tensor
    values: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] (the scaled token embeddings) -> the same with `rows` replaced, unscaled."""
        return x.index_copy(0, self.rows, self.values.to(dtype=x.dtype, device=x.device))


class DecoderModel(nn.Module):
    """The checkpoint's `model.` part: embedding, layers, final norm."""

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.embed_scale = args.embed_scale
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        recipes = [args.layer_recipe(i) for i in range(args.num_hidden_layers)]
        tables: dict[RopeRecipe, RotaryEmbedding] = {}
        self.rotary = nn.ModuleList()  # one table per distinct rope, shared by the layers that use it
        layers = []
        kv_indexes: list[int | None] = []  # each layer's index in the KV cache
        num_kv_layers = 0
        for i, recipe in enumerate(recipes):
            rope = self._rope(recipe.attention, tables)
            source = getattr(recipe.attention, "kv_source", None)
            has_kv = getattr(recipe.attention, "has_kv", True)
            # a KV-shared layer (Gemma 4) reads its source layer's cache; a recurrent one has none
            kv_indexes.append(kv_indexes[source] if source is not None else num_kv_layers if has_kv else None)
            layers.append(recipe.build(args.hidden_size, i, rope, kv_indexes[-1]))
            num_kv_layers += has_kv
        self.layers = nn.ModuleList(layers)
        self.norm = args.norm_recipe().build(args.hidden_size)
        self.per_layer_width = args.per_layer_input_width
        if self.per_layer_width:
            self._per_layer_inputs(args)

    def _rope(self, recipe: MixerRecipe | None, tables: dict[RopeRecipe, RotaryEmbedding]) -> Rope | None:
        if recipe is None or recipe.rope is None:
            return None
        key = RopeRecipe(recipe.rope.theta, recipe.rope.scaling, recipe.rope.dim)
        if key not in tables:
            tables[key] = rotary_table(key.dim, key.theta, key.scaling_dict())
            self.rotary.append(tables[key])
        return Rope(tables[key], recipe.rope, recipe.head_dim)

    def _per_layer_inputs(self, args: DecoderArgs) -> None:
        """Gemma 4's per-layer embeddings: a second token embedding of every layer's input width, and a
        projection of the token embedding to the same, normed; their mean (* 1/sqrt 2) is each layer's input."""
        total = args.num_hidden_layers * self.per_layer_width
        self.embed_tokens_per_layer = nn.Embedding(args.extra.get("vocab_size_per_layer_input") or args.vocab_size,
                                                   total)
        self.per_layer_model_projection = nn.Linear(args.hidden_size, total, bias=False)
        self.per_layer_projection_norm = args.norm_recipe().build(self.per_layer_width)
        recipe = args.norm_recipe()
        self.norm = _LeadingNorm(args.hidden_size, recipe.eps, recipe.offset)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden] (scaled); with per-layer inputs [T, hidden + layers x their width]."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            # The scale is rounded to the weights' dtype first, as the references do.
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
        return x if not self.per_layer_width else torch.cat((x, self._layer_inputs(input_ids, x)), dim=-1)

    def _layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        width = self.per_layer_width
        shape = (x.shape[0], -1, width)  # [T, layers, width]
        tokens = self.embed_tokens_per_layer(input_ids)
        tokens = tokens * torch.tensor(width**0.5, dtype=tokens.dtype, device=tokens.device)
        projected = self.per_layer_model_projection(x) * (x.shape[-1] ** -0.5)
        projected = self.per_layer_projection_norm(projected.view(shape))
        return ((projected + tokens.view(shape)) * 2**-0.5).flatten(1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                embeds: EmbeddingOverride | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        if embeds is not None:
            x = embeds.apply(x)
        for layer in self.layers:
            x = layer(x, positions, ctx)
        return self.norm(x)


class _LeadingNorm(RMSNorm):
    """The final norm over the hidden part of [T, hidden | per-layer inputs] (DecoderModel.embed)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x[..., :self.weight.shape[0]])


class DecoderLM(nn.Module):
    """Decoder-only LM: `forward` gives final hidden states, `compute_logits` the vocabulary scores."""

    ARGS: ClassVar[type[DecoderArgs]] = DecoderArgs
    # Checkpoint entries no module holds (rotary caches); families add their own.
    DROPPED_SUFFIXES: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.args = args
        self.model = DecoderModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                embeds: EmbeddingOverride | None = None) -> torch.Tensor:
        """input_ids, positions: [T] for the whole step's flat token batch -> [T, hidden]. `embeds`
        replaces the input embeddings of some rows (image placeholders, issue 43)."""
        if embeds is None:
            return self.model(input_ids, positions, ctx)
        return self.model(input_ids, positions, ctx, embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # A tied model has no lm_head until a rewrite (e.g. int8 quantization) adds one.
        if hasattr(self, "lm_head"):
            logits = self.lm_head(hidden)
        else:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        if self.args.logit_scale is not None:
            logits = logits * self.args.logit_scale
        cap = self.args.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    @classmethod
    def sanitize(cls, weights: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        """Drop checkpoint entries this module does not hold (rotary caches, a tied head)."""
        kept = {k: v for k, v in weights.items() if not k.endswith(cls.DROPPED_SUFFIXES)}
        if args.tie_word_embeddings:
            kept.pop("lm_head.weight", None)
        return kept


def combined(weights: dict[str, Any], keys: list[str], build: Callable[[list[torch.Tensor]], torch.Tensor]) -> Any:
    """`build` over the checkpoint values at `keys` (`split_fused`'s inverse: MoE expert stacks, MLA's kv_b from
    GGUF's k_b and v_b): now for tensors, on first read for lazy readers (loading/lazy.py)."""
    parts = [weights[k] for k in keys]
    if all(isinstance(p, torch.Tensor) for p in parts):
        return build(parts)
    return lambda _name: build([reader(key) for key, reader in zip(keys, parts)])


def split_fused(weights: dict[str, Any], fused: str, parts: Mapping[str, int | None]) -> None:
    """Split every `*.{fused}.weight|bias` into `parts` (name -> rows; None: the rest), in place:
    Phi-3's qkv_proj and gate_up_proj, GLM-4's gate_up_proj.

    A value may be a lazy reader (loading/lazy.py): each part then reads only its own rows when its
    module first runs (through the reader's `rows`, or else from the whole tensor, copied out so the
    part does not keep the fused tensor alive)."""
    for name in [n for n in weights if n.rsplit(".", 2)[-2:-1] == [fused]]:
        stem, kind = name.rsplit(".", 1)
        prefix = stem[:-len(fused)]
        value, start = weights.pop(name), 0
        for part, rows in parts.items():
            stop = start + rows if rows is not None else None
            weights[f"{prefix}{part}.{kind}"] = _rows_of(value, name, start, stop)
            start = stop if stop is not None else start


def _rows_of(value: Any, name: str, start: int, stop: int | None) -> Any:
    """Rows [start, stop) of a tensor, or a reader of them."""
    if isinstance(value, torch.Tensor):
        return value[start:stop]
    if hasattr(value, "rows"):
        return lambda _name: value.rows(start, stop if stop is not None else value.shape[0])
    return lambda _name: value(name)[start:stop].clone()
