"""The CPU decode step's decoder layers as one C++ call (`--decode-step native`, the CPU default).

A decode step on the CPU is a row or a few through 30-odd small layers: run as torch ops, eager
or compiled one layer at a time, each layer paid ~100 us of Python, Dynamo guards and dispatch
around ~150 us of arithmetic (bench/RESULTS.md); compiling the whole stack as one graph removed
most of that but took 35-107 s at every start. `layers/kernels/decode_layers.cpp` runs the
whole stack of a Llama-layout model in C++ instead: the weight-only matmuls (the Python path's
decode kernels, layers/quant.py), the paged-attention op, and the glue between them as loops.
This module checks that a model has that layout, collects its tensors once, and calls the op.

Taken: decoder layers whose family vouches for the Llama layout (`NATIVE_LAYOUT`: Llama, SmolLM2,
Qwen2; RMSNorm, q/k/v and gate/up fused, RoPE, SiLU MLP) with packed weight-only linears
(`--quantize auto`), over a dense KV cache, without LoRA. Anything else (`unsupported` says
what, and the log repeats it) keeps the torch.compile'd step.
"""

from __future__ import annotations

import torch
from torch import nn

from mlxcel.engine.kv.tensors import KVCache
from mlxcel.layers import paged_attention
from mlxcel.layers.norm import RMSNorm
from mlxcel.layers.quant import FusedQuantLinear, QuantLinear
from mlxcel.layers.rope import RotaryEmbedding

DENSE_CACHES = ("f32", "bf16", "f16")


def unsupported(model: nn.Module, kv_cache: KVCache, *, has_lora: bool) -> str | None:
    """Why the native layers cannot run this model's decode step; None when they can."""
    if has_lora:
        return "LoRA adapters are loaded"
    if kv_cache.k_type not in DENSE_CACHES or kv_cache.k_type != kv_cache.v_type:
        return f"the KV cache is {kv_cache.k_type}/{kv_cache.v_type} (native layers read one dense type)"
    if not paged_attention.available():
        return "the CPU kernels could not be built"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return "the model has no decoder layers"
    for layer in layers:
        if getattr(layer, "native_layout", None) != "llama":  # its recipe is the Llama layout (layers/decoder.py)
            return f"{type(layer).__module__}.{type(layer).__name__} is not a Llama-layout decoder layer"
        attn, mlp = layer.self_attn, layer.mlp
        linears = (getattr(attn, "fused_q_k_v", None), attn.o_proj, getattr(mlp, "fused_gate_up", None), mlp.down_proj)
        if not all(_packed(lin) is not None for lin in linears):
            return "its linears are not packed weight-only ones (--quantize off?)"
        if any(norm.offset != 0.0 for norm in (layer.input_layernorm, layer.post_attention_layernorm)):
            return "its norms are not plain RMSNorm"
    return None


def _packed(module: nn.Module | None) -> QuantLinear | None:
    if isinstance(module, FusedQuantLinear):
        module = module.linear
    return module if isinstance(module, QuantLinear) else None


class NativeLayers:
    """A supported model's decoder stack as the op's flat inputs, collected once (after lazy weights load)."""

    def __init__(self, model: nn.Module, kv_cache: KVCache, layers: range | None = None) -> None:
        """`layers`: the decoder layers this call runs (all by default); a range of them lets the
        decode step read the hidden states between two calls (DFlash's target features)."""
        inner = model.model
        layers = layers if layers is not None else range(len(inner.layers))
        first = inner.layers[0]
        self.rotary: RotaryEmbedding = first.self_attn.rope[0].table
        self.dims = [first.self_attn.num_heads, first.self_attn.num_kv_heads, first.self_attn.head_dim]
        self.scale = first.self_attn.scale
        self.eps = first.input_layernorm.eps
        self.windows = [getattr(inner.layers[i].self_attn, "window", None) or 0 for i in layers]
        self.weights: list[torch.Tensor] = []
        for layer in (inner.layers[i] for i in layers):
            attn, mlp = layer.self_attn, layer.mlp
            self.weights.append(_norm_weight(layer.input_layernorm))
            self.weights += _linear_tensors(attn.fused_q_k_v)
            self.weights += _linear_tensors(attn.o_proj)
            self.weights.append(_norm_weight(layer.post_attention_layernorm))
            self.weights += _linear_tensors(mlp.fused_gate_up)
            self.weights += _linear_tensors(mlp.down_proj)
        self.k_caches = [kv_cache.k[i] for i in layers]
        self.v_caches = [kv_cache.v[i] for i in layers]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, key_slots: torch.Tensor,
                 key_pos: torch.Tensor) -> torch.Tensor:
        """x [B, hidden] (embedded tokens) -> the last layer's output [B, hidden] float32; writes the rows' KV."""
        cos, sin = self.rotary.cos_sin(positions, torch.float32)
        return torch.ops.mlxcel.decode_layers(
            x.float(), cos.reshape(len(positions), -1), sin.reshape(len(positions), -1), slot_mapping, key_slots,
            key_pos, positions, self.weights, self.k_caches, self.v_caches, self.windows, self.dims, self.eps,
            self.scale)


def _norm_weight(norm: RMSNorm) -> torch.Tensor:
    return norm.effective_weight().float().contiguous()


def _linear_tensors(module: nn.Module) -> list[torch.Tensor]:
    linear = _packed(module)
    assert linear is not None  # unsupported() checked it
    bias = linear.bias if linear.bias is not None else torch.empty(0, dtype=torch.bfloat16)
    return [linear.qweight, linear.scale, bias]
