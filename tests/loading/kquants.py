"""Q4_K, Q5_K and Q6_K blocks for tests, written from llama.cpp's block layouts (ggml-common.h).

The `gguf` package dequantizes K-quants but cannot quantize them, so the tensor-type tests
build their own blocks. These encoders use plain min/max scales (llama.cpp searches for
better ones), which is enough to check that a file decodes back within the format's error.
Also here: row-at-a-time reference decoders written from llama.cpp's `dequantize_row_q*_K`
loops, to check the vectorised decoder on the real checkpoints' blocks.
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # values per super-block


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _blocks(values: np.ndarray, sub_size: int) -> np.ndarray:
    # [num_blocks, QK_K // sub_size, sub_size]
    assert values.shape[-1] % QK_K == 0, "K-quant rows must be a multiple of 256 values"
    return values.astype(np.float32).reshape(-1, QK_K // sub_size, sub_size)


def _pack_scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and eight 6-bit mins in 12 bytes (llama.cpp's get_scale_min_k4 reversed)."""
    out = np.zeros((ls.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 0x0F) | ((lm[:, 4:8] & 0x0F) << 4)
    return out


def _affine_levels(x: np.ndarray, max_level: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per 32-value sub-block x ~= d*ls*q - dmin*lm with 6-bit ls/lm: (d, dmin, ls, lm, q)."""
    mins = np.maximum(-x.min(axis=-1), 0.0)  # [blocks, 8], stored as a positive offset
    scales = (x.max(axis=-1) + mins) / max_level
    d = _f16(scales.max(axis=-1) / 63.0)
    dmin = _f16(mins.max(axis=-1) / 63.0)
    ls = _levels(scales, d.astype(np.float32), 63)
    lm = _levels(mins, dmin.astype(np.float32), 63)
    step = (d.astype(np.float32)[:, None] * ls)[..., None]
    offset = (dmin.astype(np.float32)[:, None] * lm)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint((x + offset) / step), 0)
    return d, dmin, np.stack([ls, lm]), np.clip(q, 0, max_level).astype(np.uint8)


def _levels(values: np.ndarray, unit: np.ndarray, top: int) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        levels = np.where(unit[:, None] > 0, np.rint(values / unit[:, None]), 0)
    return np.clip(levels, 0, top).astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    # Sub-blocks 2c and 2c+1 share 32 bytes: low nibble, then high nibble. -> [blocks, 128]
    low, high = q[:, 0::2] & 0x0F, q[:, 1::2] & 0x0F
    return (low | (high << 4)).reshape(q.shape[0], -1)


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """Rows of float values -> Q4_K blocks, [rows, cols / 256 * 144] uint8."""
    x = _blocks(values, 32)
    d, dmin, (ls, lm), q = _affine_levels(x, 15)
    parts = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), _pack_scales_k4(ls, lm), _nibbles(q)]
    return np.concatenate(parts, axis=1).reshape(values.shape[0], -1)


def quantize_q5_k(values: np.ndarray) -> np.ndarray:
    """Rows of float values -> Q5_K blocks, [rows, cols / 256 * 176] uint8."""
    x = _blocks(values, 32)
    d, dmin, (ls, lm), q = _affine_levels(x, 31)
    # Bit 4 of sub-block j's value l lives in bit j of qh[l].
    qh = ((q >> 4) & 1).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]
    qh = np.bitwise_or.reduce(qh, axis=1)
    parts = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), _pack_scales_k4(ls, lm), qh,
             _nibbles(q)]
    return np.concatenate(parts, axis=1).reshape(values.shape[0], -1)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """Rows of float values -> Q6_K blocks, [rows, cols / 256 * 210] uint8."""
    x = _blocks(values, 16)  # [blocks, 16, 16]
    scales = np.abs(x).max(axis=-1) / 31.0
    d = _f16(np.abs(scales).max(axis=-1) / 127.0)
    sc = _levels(scales, d.astype(np.float32), 127)  # scales are >= 0, so int8 holds them
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint(x / step), 0)
    u = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128 values
    ql = (u[:, :, 0:64] & 0x0F) | ((u[:, :, 64:128] & 0x0F) << 4)  # [blocks, 2, 64]
    hi = (u >> 4).reshape(-1, 2, 4, 32)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # [blocks, 2, 32]
    parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8),
             d.view(np.uint8).reshape(-1, 2)]
    return np.concatenate(parts, axis=1).reshape(values.shape[0], -1)


# ---- reference decoders, one block at a time, as llama.cpp's C loops read them --------------------

def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    if j < 4:
        return int(q[j] & 63), int(q[j + 4] & 63)
    return int((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)), int((q[j + 4] >> 4) | ((q[j] >> 6) << 4))


def _half(raw: np.ndarray) -> float:
    return float(raw[:2].copy().view(np.float16)[0])


def reference_dequantize_q4_k(block: np.ndarray) -> np.ndarray:
    d, dmin, scales, qs = _half(block[0:2]), _half(block[2:4]), block[4:16], block[16:144]
    out, is_ = [], 0
    for j in range(0, QK_K, 64):
        chunk = qs[j // 2: j // 2 + 32]
        for shift in (0, 4):
            sc, m = _scale_min_k4(is_, scales)
            out.extend(d * sc * ((int(b) >> shift) & 0xF) - dmin * m for b in chunk)
            is_ += 1
    return np.array(out, dtype=np.float32)


def reference_dequantize_q6_k(block: np.ndarray) -> np.ndarray:
    ql, qh, sc, d = block[0:128], block[128:192], block[192:208].view(np.int8), _half(block[208:210])
    out = np.zeros(QK_K, dtype=np.float32)
    for n in range(0, QK_K, 128):
        half_ql, half_qh, half_sc = ql[n // 2:], qh[n // 4:], sc[n // 16:]
        for l in range(32):
            s = l // 16
            q1 = ((int(half_ql[l]) & 0xF) | (((int(half_qh[l]) >> 0) & 3) << 4)) - 32
            q2 = ((int(half_ql[l + 32]) & 0xF) | (((int(half_qh[l]) >> 2) & 3) << 4)) - 32
            q3 = ((int(half_ql[l]) >> 4) | (((int(half_qh[l]) >> 4) & 3) << 4)) - 32
            q4 = ((int(half_ql[l + 32]) >> 4) | (((int(half_qh[l]) >> 6) & 3) << 4)) - 32
            out[n + l] = d * half_sc[s] * q1
            out[n + l + 32] = d * half_sc[s + 2] * q2
            out[n + l + 64] = d * half_sc[s + 4] * q3
            out[n + l + 96] = d * half_sc[s + 6] * q4
    return out


def reference_dequantize_q5_0(block: np.ndarray) -> np.ndarray:
    d, qh, qs = _half(block[0:2]), int.from_bytes(block[2:6].tobytes(), "little"), block[6:22]
    low = [((int(b) & 0xF) | (((qh >> j) & 1) << 4)) - 16 for j, b in enumerate(qs)]
    high = [((int(b) >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16 for j, b in enumerate(qs)]
    return np.array(low + high, dtype=np.float32) * d


def reference_dequantize_q8_0(block: np.ndarray) -> np.ndarray:
    return block[2:34].view(np.int8).astype(np.float32) * _half(block[0:2])


def reference_dequantize_q4_1(block: np.ndarray) -> np.ndarray:
    d, m, qs = _half(block[0:2]), _half(block[2:4]), block[4:20]
    return np.array([d * (int(b) & 0xF) + m for b in qs] + [d * (int(b) >> 4) + m for b in qs], dtype=np.float32)
