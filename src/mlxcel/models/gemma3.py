"""Gemma 3 text family: parameter names equal the HF checkpoint's (Gemma3ForCausalLM).

Differences from Llama: embeddings scaled by sqrt(hidden); (1 + w) RMSNorms, also on q and k
per head; norms before and after both attention and MLP; tanh-GELU MLP; a fixed query scale
(query_pre_attn_scalar); sliding-window layers with their own rope theta, interleaved with
global layers (which alone take the rope scaling).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from mlxcel.layers.attention import AttentionContext
from mlxcel.layers.norm import RMSNorm
from mlxcel.layers.quant import GATE_UP, QKV, linear, project
from mlxcel.layers.rope import RotaryEmbedding, apply_rope, rope_settings

if TYPE_CHECKING:
    from mlxcel.models._gguf import GGUFTensors

SLIDING, FULL = "sliding_attention", "full_attention"
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


@dataclass(frozen=True)
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0  # global layers
    rope_scaling: dict[str, Any] | None = None  # global layers only
    rope_local_base_freq: float = 10_000.0
    rope_local_scaling: dict[str, Any] | None = None
    query_pre_attn_scalar: float = 256.0
    sliding_window: int | None = 4096  # applies to the sliding layers only
    layer_types: tuple[str, ...] = ()
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    hidden_activation: str = "gelu_pytorch_tanh"
    final_logit_softcapping: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        _check_supported(config)
        config = {**config, **_rope_fields(config), "layer_types": _layer_types(config),
                  "hidden_activation": config.get("hidden_activation") or "gelu_pytorch_tanh"}
        names = {f.name for f in fields(cls)}
        known = {k: v for k, v in config.items() if k in names and k != "extra"}
        return cls(**known, extra={k: v for k, v in config.items() if k not in names})

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim

    def layer_window(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING else None


def _check_supported(config: dict[str, Any]) -> None:
    # NOTE: ctx.attend has no score soft-capping; Gemma 3 checkpoints do not use it (Gemma 2 did).
    if config.get("attn_logit_softcapping"):
        raise ValueError("gemma3: attn_logit_softcapping is not supported")
    if config.get("use_bidirectional_attention"):
        raise ValueError("gemma3: use_bidirectional_attention (an embedding model) is not supported")
    activation = config.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation not in ACTIVATIONS:
        raise ValueError(f"gemma3: hidden_activation {activation!r} is not supported "
                         f"(supported: {', '.join(ACTIVATIONS)})")


def _rope_fields(config: dict[str, Any]) -> dict[str, Any]:
    """Global and local rope from `rope_parameters` (keyed by layer type) or the older flat keys."""
    theta, scaling = rope_settings(config, FULL, default_theta=1_000_000.0)
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(SLIDING), dict):
        local_theta, local_scaling = rope_settings(config, SLIDING)
    else:
        local_theta, local_scaling = float(config.get("rope_local_base_freq") or 10_000.0), None
    return {"rope_theta": theta, "rope_scaling": scaling,
            "rope_local_base_freq": local_theta, "rope_local_scaling": local_scaling}


def _layer_types(config: dict[str, Any]) -> tuple[str, ...]:
    if config.get("layer_types"):
        return tuple(config["layer_types"])
    # Older configs give a pattern: every n-th layer is global, the rest slide.
    pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6)
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(config["num_hidden_layers"]))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = args.num_attention_heads, args.kv_heads
        self.head_dim = args.dim_per_head
        self.scale = float(args.query_pre_attn_scalar) ** -0.5
        self.window = args.layer_window(layer_idx)
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_out, bias=args.attention_bias)
        self.k_proj = nn.Linear(args.hidden_size, kv_out, bias=args.attention_bias)
        self.v_proj = nn.Linear(args.hidden_size, kv_out, bias=args.attention_bias)
        self.o_proj = nn.Linear(q_out, args.hidden_size, bias=args.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps, offset=1.0)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps, offset=1.0)
        self.rope = [rope]  # a list keeps the shared module out of this one's parameters

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        t = x.shape[0]
        q_out, k_out, v_out = project(self, x, QKV, ctx)
        q = self.q_norm(q_out.view(t, self.num_heads, self.head_dim))
        k = self.k_norm(k_out.view(t, self.num_kv_heads, self.head_dim))
        v = v_out.view(t, self.num_kv_heads, self.head_dim)
        cos, sin = self.rope[0].cos_sin(positions, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = ctx.attend(self.layer_idx, q, k, v, scale=self.scale, window=self.window)
        return linear(self.o_proj, out.reshape(t, -1), ctx)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.act = ACTIVATIONS[args.hidden_activation]

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        gate, up = project(self, x, GATE_UP, ctx)
        return linear(self.down_proj, self.act(gate) * up, ctx)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer_idx, rope)
        self.mlp = MLP(args)
        norm = lambda: RMSNorm(args.hidden_size, args.rms_norm_eps, offset=1.0)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), ctx))


class Gemma3Model(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_scale = args.hidden_size**0.5
        self.rotary_global = RotaryEmbedding(args.head_dim, args.rope_theta, args.rope_scaling)
        self.rotary_local = RotaryEmbedding(args.head_dim, args.rope_local_base_freq, args.rope_local_scaling)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i, self._rope_for(args, i))
                                    for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, offset=1.0)

    def _rope_for(self, args: ModelArgs, layer_idx: int) -> RotaryEmbedding:
        return self.rotary_local if args.layer_types[layer_idx] == SLIDING else self.rotary_global

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # The scale is rounded to the weights' dtype first, as the reference does.
        return x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, positions, ctx)
        return self.norm(x)


class Model(nn.Module):
    """Decoder-only LM: `forward` gives final hidden states, `compute_logits` the vocabulary scores."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Gemma3Model(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """input_ids, positions: [T] for the whole step's flat token batch -> [T, hidden]."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # A tied model has no lm_head until a rewrite (e.g. int8 quantization) adds one.
        if hasattr(self, "lm_head"):
            logits = self.lm_head(hidden)
        else:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        cap = self.args.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    @staticmethod
    def sanitize(weights: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
        """Text weights only: multimodal checkpoints nest them under a language model prefix."""
        kept: dict[str, torch.Tensor] = {}
        for name, value in weights.items():
            name = _text_name(name)
            if name is not None and not name.endswith("rotary_emb.inv_freq"):
                kept[name] = value
        if args.tie_word_embeddings:
            kept.pop("lm_head.weight", None)
        return kept


# Prefixes of the text model inside Gemma3ForConditionalGeneration (transformers 4 and 5 layouts).
_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                  "language_model.lm_head.": "lm_head."}
_VISION_MARKERS = ("vision_tower.", "multi_modal_projector.")


def _text_name(name: str) -> str | None:
    if any(marker in name for marker in _VISION_MARKERS):
        return None
    for prefix, replacement in _TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name


# GGUF per-layer tensor names that differ from the Llama mapping.
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    """Settings llama.cpp fixes in code for gemma3 rather than storing them in the file."""
    config = {**config, "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6}
    # llama.cpp: 27B (62 layers) scales queries by hidden/heads, every other size by head_dim.
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    is_27b = config["num_hidden_layers"] == 62
    config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"] if is_27b else head_dim
    return config


def fix_gguf_weights(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """llama.cpp's converter stores every Gemma norm as (1 + w); the HF weight is w."""
    for name in list(state):
        if name.endswith("norm.weight"):
            state[name] = state[name] - 1.0
    return state
