"""Llama family (Llama 2/3, SmolLM2, ...): parameter names equal the HF checkpoint's."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from mlxcel.layers.attention import AttentionContext
from mlxcel.layers.norm import RMSNorm
from mlxcel.layers.quant import GATE_UP, QKV, linear, project
from mlxcel.layers.rope import RotaryEmbedding, apply_rope, rope_settings

if TYPE_CHECKING:
    from mlxcel.models._gguf import GGUFTensors


@dataclass(frozen=True)
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        theta, scaling = rope_settings(config)
        config = {**config, "rope_theta": theta, "rope_scaling": scaling}
        names = {f.name for f in fields(cls)}
        known = {k: v for k, v in config.items() if k in names and k != "extra"}
        return cls(**known, extra={k: v for k, v in config.items() if k not in names})

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def sliding_window(self) -> int | None:
        return None


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = args.num_attention_heads, args.kv_heads
        self.head_dim = args.dim_per_head
        self.scale = self.head_dim**-0.5
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_out, bias=args.attention_bias)
        self.k_proj = nn.Linear(args.hidden_size, kv_out, bias=args.attention_bias)
        self.v_proj = nn.Linear(args.hidden_size, kv_out, bias=args.attention_bias)
        self.o_proj = nn.Linear(q_out, args.hidden_size, bias=args.attention_bias)
        self.rope = [rope]  # a list keeps the shared module out of this one's parameters

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        t = x.shape[0]
        q_out, k_out, v_out = project(self, x, QKV, ctx)
        q = q_out.view(t, self.num_heads, self.head_dim)
        k = k_out.view(t, self.num_kv_heads, self.head_dim)
        v = v_out.view(t, self.num_kv_heads, self.head_dim)
        cos, sin = self.rope[0].cos_sin(positions, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = ctx.attend(self.layer_idx, q, k, v, scale=self.scale)
        return linear(self.o_proj, out.reshape(t, -1), ctx)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        gate, up = project(self, x, GATE_UP, ctx)
        return linear(self.down_proj, F.silu(gate) * up, ctx)


class DecoderLayer(nn.Module):
    # The function engine/native_step.py's C++ decoder layer computes (RMSNorm, q/k/v, RoPE, attention
    # over the paged cache, o_proj, residual; RMSNorm, SiLU-gated MLP, residual): it may run this layer.
    NATIVE_LAYOUT = "llama"

    def __init__(self, args: ModelArgs, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer_idx, rope)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx)
        return x + self.mlp(self.post_attention_layernorm(x), ctx)


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(args.dim_per_head, args.rope_theta, args.rope_scaling)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i, self.rotary) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

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
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """input_ids, positions: [T] for the whole step's flat token batch -> [T, hidden]."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # A tied model has no lm_head until a rewrite (e.g. int8 quantization) adds one.
        if hasattr(self, "lm_head"):
            return self.lm_head(hidden)
        return F.linear(hidden, self.model.embed_tokens.weight)

    @staticmethod
    def sanitize(weights: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
        """Drop checkpoint entries this module does not hold (rotary caches, a tied head)."""
        dropped = ("rotary_emb.inv_freq",)
        kept = {k: v for k, v in weights.items() if not k.endswith(dropped)}
        if args.tie_word_embeddings:
            kept.pop("lm_head.weight", None)
        return kept


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    # llama.cpp's converter interleaves each head's rotary halves; HF keeps them split.
    head_dim = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, head_dim, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    """Llama 3.x GGUFs carry their rope scaling as a `rope_freqs` tensor, not as metadata."""
    if "rope_freqs.weight" in gguf.tensors:
        factors = gguf.dequantize("rope_freqs.weight").reshape(-1).tolist()
        config = {**config, "rope_scaling": {"rope_type": "freq_factors", "factors": factors}}
    return config


def fix_gguf_weights(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Undo the q/k row permutation that GGUF applies to Llama attention weights."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    for name in list(state):
        if name.endswith("self_attn.q_proj.weight"):
            state[name] = _unpermute(state[name], heads)
        elif name.endswith("self_attn.k_proj.weight"):
            state[name] = _unpermute(state[name], kv_heads)
    return state
