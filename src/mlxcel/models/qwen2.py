"""Qwen2 / Qwen2.5 family: Llama layout plus q/k/v biases; parameter names equal the HF checkpoint's."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mlxcel.layers.attention import AttentionContext
from mlxcel.layers.norm import RMSNorm
from mlxcel.layers.quant import GATE_UP, QKV, linear, project
from mlxcel.layers.rope import RotaryEmbedding, apply_rope, rope_settings


@dataclass(frozen=True)
class ModelArgs:
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
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28
    layer_types: tuple[str, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        theta, scaling = rope_settings(config)
        config = {**config, "rope_theta": theta, "rope_scaling": scaling}
        if config.get("layer_types") is not None:
            config["layer_types"] = tuple(config["layer_types"])
        if not config.get("use_sliding_window"):  # as transformers does: the window is then unused
            config["sliding_window"] = None
        names = {f.name for f in fields(cls)}
        known = {k: v for k, v in config.items() if k in names and k != "extra"}
        return cls(**known, extra={k: v for k, v in config.items() if k not in names})

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of one layer, as transformers derives it (None: full attention)."""
        if not self.sliding_window:
            return None
        if self.layer_types is not None:
            is_sliding = self.layer_types[layer_idx] == "sliding_attention"
        else:
            is_sliding = layer_idx >= self.max_window_layers
        return self.sliding_window if is_sliding else None


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = args.num_attention_heads, args.kv_heads
        self.head_dim = args.dim_per_head
        self.scale = self.head_dim**-0.5
        self.window = args.layer_window(layer_idx)
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_out, bias=True)
        self.k_proj = nn.Linear(args.hidden_size, kv_out, bias=True)
        self.v_proj = nn.Linear(args.hidden_size, kv_out, bias=True)
        self.o_proj = nn.Linear(q_out, args.hidden_size, bias=False)
        self.rope = [rope]  # a list keeps the shared module out of this one's parameters

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        t = x.shape[0]
        q_out, k_out, v_out = project(self, x, QKV, ctx)
        q = q_out.view(t, self.num_heads, self.head_dim)
        k = k_out.view(t, self.num_kv_heads, self.head_dim)
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


class Qwen2Model(nn.Module):
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
        self.model = Qwen2Model(args)
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
        kept = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
        if args.tie_word_embeddings:
            kept.pop("lm_head.weight", None)
        return kept
