"""Rotary position embeddings (the HF "rotate half" layout), with llama3 and linear scaling."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

# "freq_factors": per-frequency divisors as GGUF stores them (`rope_freqs.weight`, llama3 models).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


def rope_settings(config: Mapping[str, Any], layer_type: str | None = None,
                  default_theta: float = 10000.0) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) from an HF config in either form.

    transformers 5 writes `rope_parameters` (flat, or keyed by layer type as Gemma 3 does);
    older configs have `rope_theta` and `rope_scaling`. Both appear on the Hub.
    """
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and layer_type is not None and isinstance(params.get(layer_type), Mapping):
        params = params[layer_type]
    if isinstance(params, Mapping) and ("rope_theta" in params or "rope_type" in params):
        theta = params.get("rope_theta", config.get("rope_theta", default_theta))
        return float(theta), _scaling_or_none(params)
    return float(config.get("rope_theta") or default_theta), _scaling_or_none(config.get("rope_scaling"))


def _scaling_or_none(params: Mapping[str, Any] | None) -> dict[str, Any] | None:
    kind = rope_type(params)
    if kind == "default":
        return None
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling type {kind!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    return {k: v for k, v in (params or {}).items() if k != "rope_theta"}


def rope_type(scaling: Mapping[str, Any] | None) -> str:
    """The scaling kind, "default" when there is none (old configs spell the key `type`)."""
    return str((scaling or {}).get("rope_type", (scaling or {}).get("type")) or "default")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, with the checkpoint's rope scaling applied."""
    # NOTE: float32 throughout, as transformers computes them: float64 here alone moved real
    # models' logits by ~5e-5 from the reference; float32 makes them bit-identical.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_type(scaling)
    if kind == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling or {})
    elif kind == "linear":
        inv_freq = inv_freq / float((scaling or {})["factor"])
    elif kind == "freq_factors":
        inv_freq = inv_freq / torch.tensor((scaling or {})["factors"], dtype=torch.float32)
    elif kind != "default":
        raise ValueError(f"rope scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    return inv_freq.to(torch.float32)


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Caches cos/sin for positions up to `max_positions` and grows the cache on demand."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None,
                 max_positions: int = 4096) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.max_positions = max_positions
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self._tables = (torch.empty(0), torch.empty(0))  # cos and signed sin [positions, head_dim]
        # (positions, cos, sin) of the last lookup: one attribute, written and read whole, as two
        # engines over one model (the tests' `engine_like`) run it on two threads.
        self._memo: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] = (None, *self._tables)
        if self.inv_freq.device.type != "meta":
            self._build(max_positions)

    def rebuild_buffers(self, device: torch.device | str) -> None:
        """Recreate the tables after the model was built on the meta device."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        self._build(self.max_positions)

    def _build(self, num_positions: int) -> None:
        t = torch.arange(num_positions, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [num_positions, head_dim]
        sin = emb.sin()
        # Rotate-half as a roll: rotate_half(x) * sin == roll(x, half) * sin_signed (see apply_rope).
        half = emb.shape[-1] // 2
        self._tables = (emb.cos(), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (first half negated) of shape [T, 1, head_dim], for apply_rope.

        Every layer of a step asks with the same `positions` tensor: the answer is kept for
        that tensor, so the table lookup (and the host sync of `max()`) happens once a step.
        """
        if torch.compiler.is_compiling() or _is_capturing():
            return self.lookup(positions, dtype)
        memo_positions, cos, sin = self._memo
        if positions is memo_positions and dtype == cos.dtype:
            return cos, sin
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if needed > self._tables[0].shape[0] or self._tables[0].device != self.inv_freq.device:
            self._build(max(needed, 2 * self._tables[0].shape[0]))
        table_cos, table_sin = self._tables
        cos, sin = table_cos[positions].unsqueeze(1).to(dtype), table_sin[positions].unsqueeze(1).to(dtype)
        self._memo = (positions, cos, sin)
        return cos, sin


    def ensure_positions(self, num_positions: int) -> None:
        """Build the tables for positions below `num_positions` now, for steps that cannot grow them
        while they run (a compiled or captured decode step)."""
        if num_positions > self._tables[0].shape[0] or self._tables[0].device != self.inv_freq.device:
            self._build(max(num_positions, self._tables[0].shape[0]))

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos_sin` without memo or growth: traceable, for positions `ensure_positions` covered."""
        cos, sin = self._tables
        return cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)


def _is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [T, num_heads, head_dim]; HF's rotate-half layout, with cos/sin from `cos_sin`.

    x * cos + cat(-x2, x1) * sin, written as a roll against a sin whose first half is negated:
    the same products, bit for bit, in three ops instead of six (a decode step runs 60 of them).
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed
