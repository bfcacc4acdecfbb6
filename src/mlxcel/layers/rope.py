"""Rotary position embeddings (the HF "rotate half" layout) with the scalings checkpoints use:
linear, llama3, yarn, longrope, proportional (Gemma 4), dynamic (inside the trained context:
the plain frequencies, as transformers computes them there), GGUF's freq_factors, and the
multimodal rotary (M-RoPE, Qwen-VL: temporal / height / width positions, one per frequency section)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

# "freq_factors": per-frequency divisors as GGUF stores them (`rope_freqs.weight`, llama3 models).
# "mrope": Qwen-VL's multimodal rotary (`mrope_section`, `mrope_interleaved`), the plain frequencies.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "proportional", "freq_factors",
                        "mrope")


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
        return float(theta), _with_context(_scaling_or_none(params), config)
    return float(config.get("rope_theta") or default_theta), _with_context(_scaling_or_none(config.get("rope_scaling")), config)


def _with_context(scaling: dict[str, Any] | None, config: Mapping[str, Any]) -> dict[str, Any] | None:
    """yarn and longrope may leave their context lengths to the config's top level."""
    if scaling is None or rope_type(scaling) not in ("yarn", "longrope"):
        return scaling
    for key in ("max_position_embeddings", "original_max_position_embeddings"):
        if scaling.get(key) is None and config.get(key) is not None:
            scaling = {**scaling, key: config[key]}
    return scaling


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
    """Inverse frequencies [head_dim // 2] in float32, with the checkpoint's rope scaling applied
    (longrope: its short factors; `RotaryEmbedding` takes the long ones past the trained context)."""
    # NOTE: float32 throughout, as transformers computes them: float64 here alone moved real
    # models' logits by ~5e-5 from the reference; float32 makes them bit-identical.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind, params = rope_type(scaling), scaling or {}
    if kind == "llama3":
        inv_freq = _llama3_scale(inv_freq, params)
    elif kind == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif kind == "freq_factors":
        inv_freq = inv_freq / torch.tensor(params["factors"], dtype=torch.float32)
    elif kind == "yarn":
        inv_freq = _yarn_scale(head_dim, theta, params)
    elif kind == "longrope":
        inv_freq = inv_freq / torch.tensor(params["short_factor"], dtype=torch.float32)
    elif kind == "proportional":
        inv_freq = _proportional(head_dim, theta, params)
    elif kind not in ("default", "dynamic", "mrope"):
        raise ValueError(f"rope scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    return inv_freq.to(torch.float32)


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor yarn and longrope multiply cos and sin by (1.0 for the other kinds)."""
    kind, params = rope_type(scaling), scaling or {}
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = _scaling_factor(params)
    if kind == "yarn":
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all:
            return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        return _yarn_mscale(factor)
    if kind == "longrope" and factor > 1.0:
        return math.sqrt(1 + math.log(factor) / math.log(params["original_max_position_embeddings"]))
    return 1.0


def _scaling_factor(params: Mapping[str, Any]) -> float:
    """`factor`, or (DeepSeek, Phi-3) the served context over the trained one."""
    if params.get("factor") is not None:
        return float(params["factor"])
    return float(params.get("max_position_embeddings", 1)) / float(params.get("original_max_position_embeddings", 1))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_scale(dim: int, theta: float, params: Mapping[str, Any]) -> torch.Tensor:
    """YaRN: each frequency between extrapolated (fast ones) and interpolated by `factor` (slow
    ones), ramped linearly across the dimensions the paper's correction range covers."""
    factor = _scaling_factor(params)
    original = float(params["original_max_position_embeddings"])
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def _proportional(head_dim: int, theta: float, params: Mapping[str, Any]) -> torch.Tensor:
    """Gemma 4's: the first `partial_rotary_factor` of the angles rotate, over the whole head_dim's
    exponents; the rest have frequency 0 (cos 1, sin 0: unrotated)."""
    angles = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    rotated = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
    inv_freq = torch.cat((rotated, torch.zeros(head_dim // 2 - angles)))
    return inv_freq / float(params.get("factor", 1.0))


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
        if rope_type(self.scaling) == "longrope":  # the long factors past the trained context
            original = int(self.scaling["original_max_position_embeddings"])
            long_inv = rope_inv_freq(self.head_dim, self.theta, {"rope_type": "linear", "factor": 1.0})
            long_inv = long_inv.to(t.device) / torch.tensor(self.scaling["long_factor"], device=t.device)
            freqs = torch.where((t >= original)[:, None], torch.outer(t, long_inv), freqs)
        emb = torch.cat((freqs, freqs), dim=-1)  # [num_positions, head_dim]
        factor = rope_attention_factor(self.scaling)
        sin = emb.sin() * factor if factor != 1.0 else emb.sin()
        # Rotate-half as a roll: rotate_half(x) * sin == roll(x, half) * sin_signed (see apply_rope).
        half = emb.shape[-1] // 2
        cos = emb.cos() * factor if factor != 1.0 else emb.cos()
        self._tables = (cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1))

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


class MRotaryEmbedding(RotaryEmbedding):
    """Qwen-VL's M-RoPE: positions [3, T] (temporal, height, width) turn the frequency sections
    `mrope_section` (contiguous, or every third frequency with `mrope_interleaved`, Qwen3-VL).

    Text tokens have three equal positions, which is the plain rotary of one position: positions
    [T] take the inherited table lookup."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any], max_positions: int = 4096) -> None:
        super().__init__(head_dim, theta, scaling, max_positions)
        axis = mrope_axis_of_frequency(head_dim // 2, scaling["mrope_section"], bool(scaling.get("mrope_interleaved")))
        self.register_buffer("axis", torch.cat((axis, axis)), persistent=False)  # [head_dim]

    def rebuild_buffers(self, device: torch.device | str) -> None:
        super().rebuild_buffers(device)
        axis = mrope_axis_of_frequency(self.head_dim // 2, self.scaling["mrope_section"],
                                       bool(self.scaling.get("mrope_interleaved")))
        self.axis = torch.cat((axis, axis)).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().cos_sin(positions, dtype)
        memo_positions, cos, sin = self._memo
        if positions is memo_positions and dtype == cos.dtype:
            return cos, sin
        self.ensure_positions(int(positions.max()) + 1 if positions.numel() else 0)
        cos, sin = self.lookup(positions, dtype)
        self._memo = (positions, cos, sin)
        return cos, sin

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().lookup(positions, dtype)
        # [3, T, head_dim] -> each dimension from its axis' row: [T, 1, head_dim]
        index = self.axis.view(1, 1, -1).expand(1, positions.shape[1], -1)
        cos, sin = (table[positions].gather(0, index)[0] for table in self._tables)
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


def mrope_axis_of_frequency(num_freqs: int, section: Sequence[int], interleaved: bool) -> torch.Tensor:
    """Which position row (0 temporal, 1 height, 2 width) turns each of the `num_freqs` frequencies:
    `section` contiguous runs (Qwen2-VL, Qwen2.5-VL), or with `interleaved` (Qwen3-VL) frequency i
    takes height where i % 3 == 1 and i < 3 * section[1], width where i % 3 == 2 and i < 3 * section[2]."""
    if sum(section) != num_freqs:
        raise ValueError(f"mrope_section {list(section)} does not add up to {num_freqs} frequencies")
    if not interleaved:
        return torch.cat([torch.full((n,), axis, dtype=torch.int64) for axis, n in enumerate(section)])
    axis = torch.zeros(num_freqs, dtype=torch.int64)
    for row in (1, 2):
        axis[row:3 * section[row]:3] = row
    return axis


def rotary_table(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> RotaryEmbedding:
    """The table a rope's settings need: M-RoPE's for "mrope", the plain one otherwise."""
    if rope_type(scaling) == "mrope":
        return MRotaryEmbedding(head_dim, theta, scaling)
    return RotaryEmbedding(head_dim, theta, scaling)
