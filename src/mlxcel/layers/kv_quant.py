"""Element formats of the KV cache: dense dtypes, q8_0, and turbo4 (spec N2).

A cache tensor of a dense type holds the values themselves. The quantized types hold codes and
one float16 scale per block of `QBLOCK` values along the head dimension:
- `q8_0` (llama.cpp's name and layout): symmetric int8 codes, scale = absmax / 127;
- `turbo4` (`--kv-cache-mode turbo4`, `--kv-quant-scheme turboquant`): each head vector is first
  turned by a fixed random orthogonal matrix (a randomised Hadamard transform), which spreads
  outlier channels evenly so that 4 bits a value keep them; then symmetric 4-bit codes, two a
  byte, scale = absmax / 7. The turn is never undone key by key: attention turns the query the
  same way (dot products are unchanged by an orthogonal turn) and turns the weighted sum of
  values back once (`Rotation`).

Everything here is plain tensor ops, so the decode step traces through it (torch.compile, CUDA
graphs) like the dense path.
"""

from __future__ import annotations

import functools
import math

import torch

QBLOCK = 32  # values per scale, as llama.cpp's q8_0 / q4_0 blocks
DENSE_TYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
QUANTIZED_TYPES = ("q8_0", "turbo4")
KV_MODES = ("default", "turbo4")  # --kv-cache-mode
KV_QUANT_SCHEMES = ("none", "turboquant")  # --kv-quant-scheme


def element_type(cache_type: str, kv_cache_mode: str = "default", kv_quant_scheme: str = "none") -> str:
    """The element type one side (K or V) is stored in: a Turbo mode or scheme overrides --cache-type-*."""
    if kv_cache_mode == "turbo4" or kv_quant_scheme == "turboquant":
        return "turbo4"
    return cache_type


def supports(element: str, head_dim: int) -> bool:
    return element in DENSE_TYPES or head_dim % QBLOCK == 0


def bytes_per_value(element: str) -> float:
    if element in DENSE_TYPES:
        return DENSE_TYPES[element].itemsize
    code_bytes = 1.0 if element == "q8_0" else 0.5
    return code_bytes + 2 / QBLOCK  # a float16 scale a block


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, k_type: str, v_type: str | None) -> int:
    """KV bytes one token costs over every layer, scales included (`v_type` None: no values stored)."""
    per_value = bytes_per_value(k_type) + (bytes_per_value(v_type) if v_type is not None else 0.0)
    return int(num_layers * num_kv_heads * head_dim * per_value)


def storage_dim(element: str, head_dim: int) -> int:
    """The last dimension of the tensor holding codes: turbo4 packs two codes a byte."""
    return head_dim // 2 if element == "turbo4" else head_dim


def storage_dtype(element: str) -> torch.dtype:
    if element in DENSE_TYPES:
        return DENSE_TYPES[element]
    return torch.int8 if element == "q8_0" else torch.uint8


def encode(element: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., D] (turbo4: already turned) -> (codes, scales [..., D / QBLOCK] or None)."""
    if element in DENSE_TYPES:
        return x.to(DENSE_TYPES[element]), None
    levels = 127.0 if element == "q8_0" else 7.0
    blocks = x.float().unflatten(-1, (-1, QBLOCK))
    scales = (blocks.abs().amax(-1) / levels).to(torch.float16)
    step = scales.float().clamp(min=torch.finfo(torch.float16).tiny).unsqueeze(-1)
    codes = torch.round(blocks / step).clamp(-levels, levels).flatten(-2)
    if element == "q8_0":
        return codes.to(torch.int8), scales
    nibbles = (codes + 8).to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4), scales


def decode(element: str, codes: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `encode` for gathered rows, in `dtype` (turbo4: still turned)."""
    if scales is None:
        return codes.to(dtype)
    if element == "turbo4":
        low = (codes & 0x0F).to(torch.int8) - 8
        high = (codes >> 4).to(torch.int8) - 8
        values = torch.stack((low, high), dim=-1).flatten(-2)
    else:
        values = codes
    blocks = values.to(dtype).unflatten(-1, (-1, QBLOCK))
    return (blocks * scales.to(dtype).unsqueeze(-1)).flatten(-2)


class Rotation:
    """The fixed orthogonal turn of turbo4: R = H . diag(signs) / sqrt(D), H a Hadamard matrix."""

    def __init__(self, head_dim: int, device: torch.device | str) -> None:
        self.matrix = _rotation(head_dim, str(device))  # [D, D], orthogonal: R @ R.T = I

    def turn(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> x @ R, in x's dtype (computed in float32)."""
        return (x.float() @ self.matrix).to(x.dtype)

    def turn_back(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() @ self.matrix.T).to(x.dtype)


@functools.cache
def _rotation(head_dim: int, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0x7B0)  # fixed: a saved slot stays readable
    signs = torch.randint(0, 2, (head_dim,), generator=generator).float() * 2 - 1
    if head_dim & (head_dim - 1) == 0:
        hadamard = torch.ones(1, 1)
        while hadamard.shape[0] < head_dim:
            hadamard = torch.cat((torch.cat((hadamard, hadamard), 1), torch.cat((hadamard, -hadamard), 1)), 0)
        matrix = signs[:, None] * hadamard / math.sqrt(head_dim)
    else:  # no Hadamard matrix of this order: a random orthogonal one
        matrix, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=generator))
    return matrix.to(device)
