"""Reading GGUF files: metadata as plain Python values, tensors dequantized on demand.

The `gguf` package does the parsing and dequantization; this module turns its reader into
a small, typed view and turns its failures into one clear `ModelLoadError` line.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlxcel.loading.errors import ModelLoadError

# Tensor types the loader accepts (the `gguf` package dequantizes each of them; issue 42 added MXFP4, the
# I-quants and the ternary types, whose float reference is that package's dequantizer).
SUPPORTED_TENSOR_TYPES = frozenset(
    {
        "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K",
        "MXFP4", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "TQ1_0", "TQ2_0",
    }
)  # fmt: skip


KNOWN_GGUF_VERSIONS = frozenset({1, 2, 3})  # the header versions the format has had
DEQUANTIZE_CHUNK = 1 << 24  # raw bytes dequantized at a time


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    type_name: str  # e.g. "Q4_1"
    shape: tuple[int, ...]  # PyTorch order (rows first), e.g. (out_features, in_features)
    raw: np.ndarray  # the bytes as stored (quantized blocks) or the plain array


class GGUFFile:
    """One GGUF file: `metadata` (key -> Python value) and `tensors` (name -> GGUFTensor)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.metadata, self.tensors, self._map = read_header(self.path)
        except Exception as exc:  # noqa: BLE001 - the gguf package raises many kinds
            raise ModelLoadError(_unreadable_message(self.path, exc)) from exc
        self._check_tensor_types()

    def release_pages(self) -> None:
        """Drop the file's pages from this process's resident memory (they stay in the page cache, and
        a later read maps them again): each tensor read is a copy, and a loaded model would otherwise
        count the whole file a second time in its RSS."""
        with contextlib.suppress(AttributeError, OSError, ValueError):  # no madvise on this platform
            self._map.madvise(mmap.MADV_DONTNEED)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """`<architecture>.<key>` from the metadata, e.g. arch_value("block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def weight_format(self) -> dict[str, Any]:
        """What /props, /v1/models and the startup log say of the file's weights (issue 42): each tensor type
        with its number of tensors, of weights and of bytes in the file, the bits a weight over all of them and
        the bytes of tensor data (the file less its header and vocabulary)."""
        types: dict[str, dict[str, int]] = {}
        for tensor in self.tensors.values():
            entry = types.setdefault(tensor.type_name, {"tensors": 0, "weights": 0, "bytes": 0})
            entry["tensors"] += 1
            entry["weights"] += int(np.prod(tensor.shape, dtype=np.int64))
            entry["bytes"] += int(tensor.raw.nbytes)
        weights = sum(e["weights"] for e in types.values())
        tensor_bytes = sum(e["bytes"] for e in types.values())
        return {"format": "gguf", "tensor_types": dict(sorted(types.items(), key=lambda kv: -kv[1]["weights"])),
                "bits_per_weight": round(8 * tensor_bytes / max(weights, 1), 3), "tensor_bytes": tensor_bytes}

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in PyTorch shape order (a new array: the file's pages are let go)."""
        try:
            return self._dequantize(self.tensors[name])
        finally:
            self.release_pages()

    def _dequantize(self, tensor: GGUFTensor) -> np.ndarray:
        import gguf

        if tensor.type_name in ("F32", "F16"):
            return np.array(tensor.raw, dtype=np.float32).reshape(tensor.shape)
        qtype = gguf.GGMLQuantizationType[tensor.type_name]
        raw = np.asarray(tensor.raw)
        if raw.ndim < 2 or raw.size < DEQUANTIZE_CHUNK:
            return gguf.quants.dequantize(raw, qtype).astype(np.float32, copy=False).reshape(tensor.shape)
        # In slices of rows into one array: the package's own temporaries stay a slice's size (an
        # output head dequantized whole held three float32 copies of itself at once).
        rows = raw.reshape(-1, raw.shape[-1])
        out = np.empty((rows.shape[0], int(np.prod(tensor.shape)) // rows.shape[0]), dtype=np.float32)
        step = max(1, DEQUANTIZE_CHUNK // rows.shape[1])
        for start in range(0, rows.shape[0], step):
            out[start:start + step] = gguf.quants.dequantize(rows[start:start + step], qtype)
        return out.reshape(tensor.shape)

    def int4_levels(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None] | None:
        """A tensor stored in a 4-bit type (Q4_0, Q4_1, Q4_K) as its stored levels q (uint8 [N, K]),
        steps and lows (float32 [N, K / 32]): w = low + q * step, the values `dequantize` gives, read
        straight from the blocks (nothing rounded twice, no search for the grid), and for Q4_K the
        superblocks' d and -dmin (float32 [N, K / 256, 2]) of which they are integer multiples; None for
        other types."""
        tensor = self.tensors[name]
        decode = _INT4_DECODERS.get(tensor.type_name)
        if decode is None or len(tensor.shape) < 2:
            return None
        rows, cols = _as_rows(tensor.shape)
        try:
            q, step, low, units = decode(np.asarray(tensor.raw).view(np.uint8).reshape(-1, _INT4_BLOCK_BYTES[tensor.type_name]))
        finally:
            self.release_pages()
        return (q.reshape(rows, cols), step.reshape(rows, cols // 32), low.reshape(rows, cols // 32),
                None if units is None else units.reshape(rows, cols // 256, 2))

    def int8_levels(self, name: str) -> Int8Blocks | None:
        """A tensor stored as small integer codes times a scale per group (plus a low per group for Q5_1, Q5_K
        and Q2_K; `_INT8_TYPES`) as its codes (int8 [N, K]), scales and lows (float32 [N, K / group]; lows None
        where the type has none): w = low + code * scale, the values `dequantize` gives, bit for bit; and
        for a type of 256-weight superblocks their units (float32 [N, K / 256, 1 or 2]), of which the
        scales (and lows) are integer multiples; None for other types (issue 27: such a weight is kept as
        stored). Issue 42: the K-quants, the I-quants' codebooks (IQ4's 16 int8 values, IQ3 / IQ2 grid
        magnitudes with their signs), MXFP4's doubled e2m1 values and the ternary types are all such codes."""
        tensor = self.tensors[name]
        kind = _INT8_TYPES.get(tensor.type_name)
        if kind is None or len(tensor.shape) < 2:
            return None
        rows, cols = _as_rows(tensor.shape)  # a stack of experts as E * N rows (issue 40)
        codes = np.empty((rows, cols), dtype=np.int8)
        parts: list[list[np.ndarray | None]] = []
        try:
            raw = np.asarray(tensor.raw).view(np.uint8).reshape(rows, -1)
            step = max(1, DEQUANTIZE_CHUNK // raw.shape[1])
            # In slices of rows: the float temporaries stay a slice's size (Qwen2.5-1.5B's Q6_K head
            # whole: several float32 copies of 0.9 GB at once, +1 GB peak RSS at load).
            for start in range(0, rows, step):
                part = raw[start:start + step]
                part_codes, *scales = kind.decode(part)
                codes[start:start + step] = part_codes.reshape(len(part), cols)
                parts.append([None if a is None else a.astype(np.float32).reshape(len(part), -1, *a.shape[2:])
                              for a in scales])
        finally:
            self.release_pages()
        scale, low, units = (None if parts[0][i] is None else np.concatenate([p[i] for p in parts]) for i in range(3))
        return codes, scale, low, units  # type: ignore[return-value]

    def _check_tensor_types(self) -> None:
        for tensor in self.tensors.values():
            if tensor.type_name not in SUPPORTED_TENSOR_TYPES:
                raise ModelLoadError(
                    f"{self.path}: tensor {tensor.name} has type {tensor.type_name}, which is not "
                    f"supported (supported: {', '.join(sorted(SUPPORTED_TENSOR_TYPES))})"
                )


def _halves(qs: np.ndarray) -> np.ndarray:
    """Packed bytes [..., 16 or 32] -> levels [..., 2 x that]: the low nibbles, then the high ones (ggml's order)."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]


Int4Blocks = tuple[np.ndarray, np.ndarray, np.ndarray, "np.ndarray | None"]  # levels, steps, lows, units


def _q4_0(blocks: np.ndarray) -> Int4Blocks:
    d = _f16(blocks, 0)  # w = d * (q - 8)
    return _halves(blocks[:, 2:]), d, -8 * d, None


def _q4_1(blocks: np.ndarray) -> Int4Blocks:
    return _halves(blocks[:, 4:]), _f16(blocks, 0), _f16(blocks, 2), None  # w = d * q + m


def _q4_k(blocks: np.ndarray) -> Int4Blocks:
    """256 weights a block in 8 sub-blocks of 32: w = d * sc_j * q - dmin * m_j (6-bit sc_j, m_j)."""
    import gguf

    scales, mins = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    levels = _halves(blocks[:, 16:].reshape(-1, 4, 32))  # [blocks, 4, 64]: sub-blocks 2i and 2i + 1
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    return levels, d * scales.astype(np.float32), -(dmin * mins.astype(np.float32)), np.stack((d, -dmin), axis=-1)


_INT4_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k}


Int8Blocks = tuple[np.ndarray, np.ndarray, "np.ndarray | None", "np.ndarray | None"]  # codes, scales, lows, units
# A type's raw blocks [B, block bytes] -> scales [B, groups], lows (or None) and units [B, 1, 1 or 2] (or None).
ScaleReader = Callable[[np.ndarray], tuple[np.ndarray, "np.ndarray | None", "np.ndarray | None"]]

_F32 = np.float32


@dataclass(frozen=True, slots=True)
class _CodeType:
    """A GGUF type whose weights are integer codes times a scale per group (plus a low per group): how to
    read its scales from the raw blocks, and its codes straight from the bits, or else (the grid types IQ2 /
    IQ3, TQ1_0) as the package's dequantized values over their group's scale, rounded (exact: each value is
    one float32 product of the scale and a small integer)."""

    name: str
    scales: ScaleReader
    # raw blocks -> codes [B, block], read from the bits: Q5_K and Q2_K, whose lows (a min times its own 6- or
    # 4-bit scale) may dwarf a step, so that a division would lose the codes (Q5_1's low is its group's minimum,
    # within 31 steps), and the common types (5-10x faster than dividing the package's values)
    levels: Callable[[np.ndarray], np.ndarray] | None = None

    @property
    def block_bytes(self) -> int:
        import gguf

        return int(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.name]][1])

    def decode(self, rows: np.ndarray) -> Int8Blocks:
        """Raw rows [N, bytes a row] -> codes [blocks, block], scales, lows [blocks, groups], units [blocks, 1, parts]."""
        import gguf

        blocks = rows.reshape(-1, self.block_bytes)
        scale, low, units = self.scales(blocks)
        if self.levels is not None:
            return self.levels(blocks).astype(np.int8), scale, low, units
        # NOTE: rows, not blocks: the package dequantizes [blocks, bytes] a dozen times slower (MXFP4: 650 ns a weight)
        values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[self.name])
        values = values.reshape(len(blocks), scale.shape[1], -1)
        if low is not None:
            values = values - low[..., None]
        with np.errstate(divide="ignore", invalid="ignore"):
            codes = np.rint(values / scale[..., None])
        codes = np.where(scale[..., None] != 0, codes, 0).clip(-128, 127)
        return codes.reshape(len(blocks), -1).astype(np.int8), scale, low, units


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [B, n] -> [B, 2 n]: each byte's low nibble, then its high one (a scale per nibble)."""
    return ((packed[:, :, None] >> np.array([0, 4], dtype=np.uint8)) & 0x0F).reshape(len(packed), -1)


def _per_block(d: np.ndarray) -> np.ndarray:
    return d[:, None]  # [B, 1] -> units [B, 1, 1]


def _q6_k_scales(blocks: np.ndarray) -> tuple[np.ndarray, None, np.ndarray]:
    """256 weights a block in 16 groups of 16: w = d * sc_j * q (int8 sc_j at byte 192, float16 d at 208)."""
    d = _f16(blocks, 208)
    return d * blocks[:, 192:208].view(np.int8).astype(_F32), None, _per_block(d)


def _q5_k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """8 groups of 32: w = d * sc_j * q - dmin * m_j (6-bit sc_j, m_j as Q4_K packs them; q 5 bits)."""
    import gguf

    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    return d * sc.astype(_F32), -(dmin * m.astype(_F32)), np.stack((d, -dmin), axis=-1)


def _q5_k_levels(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    low = (blocks[:, 48:176].reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return (low.reshape(n, 8, 32) | (high << 4)).reshape(n, -1)


def _q2_k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """16 groups of 16: w = d * (sc_j & 15) * q - dmin * (sc_j >> 4) (q 2 bits; d, dmin at bytes 80, 82)."""
    sc, d, dmin = blocks[:, :16], _f16(blocks, 80), _f16(blocks, 82)
    return d * (sc & 0x0F).astype(_F32), -(dmin * (sc >> 4).astype(_F32)), np.stack((d, -dmin), axis=-1)


def _q2_k_levels(blocks: np.ndarray) -> np.ndarray:
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((blocks[:, 16:80].reshape(len(blocks), -1, 1, 32) >> shifts) & 3).reshape(len(blocks), -1)


def _q3_k_scales(blocks: np.ndarray) -> tuple[np.ndarray, None, np.ndarray]:
    """16 groups of 16: w = d * (sc_j - 32) * q, q in -4..3; the 6-bit sc_j at bytes 96-107 (low 4 bits
    in the first 8 bytes' nibbles, high 2 bits in the last 4 bytes' pairs), d at 108."""
    n, packed = len(blocks), blocks[:, 96:108]
    low = _nibbles(packed[:, :8]).reshape(n, 8, 2).transpose(0, 2, 1).reshape(n, 16)
    high = (packed[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)) & 3
    sc = (low | (high.reshape(n, 16) << 4)).astype(np.int8) - np.int8(32)
    d = _f16(blocks, 108)
    return d * sc.astype(_F32), None, _per_block(d)


def _q3_k_levels(blocks: np.ndarray) -> np.ndarray:
    """q = 2 low bits (bytes 32-95, 4 a byte) - 4 where the high-bit mask (bytes 0-31) is clear: -4..3."""
    n = len(blocks)
    low = (blocks[:, 32:96].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    high = (blocks[:, :32].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return low.reshape(n, -1).astype(np.int8) - ((1 - high.reshape(n, -1)) << 2).astype(np.int8)


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)  # e2m1, doubled


def _codebook_levels(values: np.ndarray, start: int, group_bytes: int) -> Callable[[np.ndarray], np.ndarray]:
    """Nibble-indexed codebooks (IQ4_NL, IQ4_XS, MXFP4): per group of `group_bytes` packed bytes from `start`,
    the low nibbles then the high ones index `values`."""

    def read(blocks: np.ndarray) -> np.ndarray:
        packed = blocks[:, start:].reshape(len(blocks), -1, group_bytes)
        return values[_halves(packed)].reshape(len(blocks), -1)

    return read


def _tq2_0_levels(blocks: np.ndarray) -> np.ndarray:
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((blocks[:, :64].reshape(len(blocks), -1, 1, 32) >> shifts) & 3).reshape(len(blocks), -1).astype(np.int8) - 1


def _iq4_xs_scales(blocks: np.ndarray) -> tuple[np.ndarray, None, np.ndarray]:
    """8 groups of 32: w = d * (ls_j - 32) * kvalue[q] (6-bit ls_j: low nibbles at byte 4, high pairs in
    the uint16 at byte 2)."""
    n = len(blocks)
    high = blocks[:, 2:4].copy().view(np.uint16).reshape(n, 1) >> (2 * np.arange(8, dtype=np.uint16))
    ls = (_nibbles(blocks[:, 4:8]) | ((high & 3).astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
    d = _f16(blocks, 0)
    return d * ls.astype(_F32), None, _per_block(d)


def _iq2_iq3_scales(at: int, count: int, mul: float) -> ScaleReader:
    """IQ2_XS / IQ2_S (16 nibble scales a block at byte `at`) and IQ3_S: w = d * (0.5 + ls) * mul * grid *
    sign (IQ3_S: d * (1 + 2 ls), `mul` 0); units d * mul / 2 (integer sub-scales 2 ls + 1)."""

    def read(blocks: np.ndarray) -> tuple[np.ndarray, None, np.ndarray]:
        d, ls = _f16(blocks, 0), _nibbles(blocks[:, at:at + count // 2])
        if mul == 0:
            return d * (1 + 2 * ls), None, _per_block(d)
        return d * (_F32(0.5) + ls) * _F32(mul), None, _per_block(d * _F32(mul / 2))

    return read


def _iq_top_nibble_scales(at: int, stride: int, mul: float) -> ScaleReader:
    """IQ2_XXS / IQ3_XXS: 8 groups of 32, ls_j the top 4 bits of every `stride`-th uint32 from byte `at`
    (IQ2_XXS's words pair with grid indices): w = d * (0.5 + ls) * mul * grid * sign."""

    def read(blocks: np.ndarray) -> tuple[np.ndarray, None, np.ndarray]:
        ls = blocks[:, at:].copy().view(np.uint32)[:, stride - 1::stride] >> 28
        d = _f16(blocks, 0)
        return d * (_F32(0.5) + ls.astype(_F32)) * _F32(mul), None, _per_block(d * _F32(mul / 2))

    return read


def _one_scale(at: int) -> ScaleReader:
    """Types with one float16 scale a block at byte `at` (Q8_0, Q5_0, IQ4_NL: groups of 32; TQ1_0, TQ2_0: 256)."""
    return lambda blocks: (_f16(blocks, at), None, None)


def _q5_1_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """Groups of 32: w = d * q + m (q 5 bits; float16 d and m at bytes 0 and 2)."""
    return _f16(blocks, 0), _f16(blocks, 2), None


def _mxfp4_scales(blocks: np.ndarray) -> tuple[np.ndarray, None, None]:
    """Groups of 32: w = 2^(e - 128) * kvalue[q] (an e8m0 exponent byte; the e2m1 values doubled)."""
    import gguf

    return gguf.quants.MXFP4.e8m0_to_fp32_half(blocks[:, :1]).astype(_F32), None, None


# The types `int8_levels` reads as codes (issue 27: Q8_0, Q5_0, Q6_K; issue 42: the rest).
_INT8_TYPES = {kind.name: kind for kind in (
    _CodeType("Q8_0", _one_scale(0)), _CodeType("Q5_0", _one_scale(0)), _CodeType("Q6_K", _q6_k_scales),
    _CodeType("Q5_1", _q5_1_scales),
    _CodeType("Q5_K", _q5_k_scales, _q5_k_levels), _CodeType("Q3_K", _q3_k_scales, _q3_k_levels),
    _CodeType("Q2_K", _q2_k_scales, _q2_k_levels),
    _CodeType("IQ4_NL", _one_scale(0), _codebook_levels(IQ4_VALUES, 2, 16)),
    _CodeType("IQ4_XS", _iq4_xs_scales, _codebook_levels(IQ4_VALUES, 8, 16)),
    _CodeType("MXFP4", _mxfp4_scales, _codebook_levels(MXFP4_VALUES, 1, 16)),
    _CodeType("TQ1_0", _one_scale(52)), _CodeType("TQ2_0", _one_scale(64), _tq2_0_levels),
    _CodeType("IQ2_XXS", _iq_top_nibble_scales(2, 2, 0.25)), _CodeType("IQ3_XXS", _iq_top_nibble_scales(66, 1, 0.5)),
    _CodeType("IQ2_XS", _iq2_iq3_scales(66, 16, 0.25)), _CodeType("IQ2_S", _iq2_iq3_scales(74, 16, 0.25)),
    _CodeType("IQ3_S", _iq2_iq3_scales(106, 8, 0)),
)}
_INT4_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}


Header = tuple[dict[str, Any], dict[str, "GGUFTensor"], Any]  # metadata, tensors, the file's mapping


def read_header(path: Path) -> Header:
    """A GGUF file's metadata and tensor table (data left in the mapping); raises ValueError or
    OSError (or the gguf package's errors, for a version 1 or big-endian file) when it is not whole."""
    header = _read_header(path)
    return header if header is not None else _read_with_gguf_reader(path)


def _read_with_gguf_reader(path: Path) -> Header:
    import gguf

    reader = gguf.GGUFReader(str(path))
    metadata = {key: _field_value(field) for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    tensors = {t.name: _tensor(t) for t in reader.tensors}
    return metadata, tensors, getattr(reader.data, "_mmap", None)


def _tensor(t: Any) -> GGUFTensor:
    # GGUF lists dimensions fastest-first; PyTorch wants them slowest-first.
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return GGUFTensor(name=t.name, type_name=t.tensor_type.name, shape=shape, raw=t.data)


# ---- the header of a little-endian version 2 or 3 file, read straight from its mapping ----------
# NOTE: the gguf package's reader builds a numpy view per element of every metadata array: 3.7 s
# for SmolLM2's 49k-token vocabulary and merges, 10.6 s for Qwen2.5's 151k, at every start. The
# format is a flat sequence of typed values (github.com/ggml-org/ggml docs/gguf.md); read here in
# 0.1-0.3 s. Tensor data stays in the mapping, as the package's reader leaves it.

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
                 12: "<f8"}
_PLAIN_TENSORS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}


class _Cursor:
    """Reads typed values from a mapped file, refusing any that would run past its end."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size)
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        size = self.take("<Q")
        self.need(size)
        value = self.data[self.pos:self.pos + size]
        self.pos += size
        return value.decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind} at byte {self.pos}")
        item, count = self.take("<I"), self.take("<Q")
        if item in _ARRAY_DTYPES:
            dtype = np.dtype(_ARRAY_DTYPES[item])
            self.need(count * dtype.itemsize)
            values = np.frombuffer(self.data, dtype, count, self.pos).tolist()
            self.pos += count * dtype.itemsize
            return values
        self.need(count * 8)  # a string or an array is at least its 8-byte length
        return [self.value(item) for _ in range(count)]

    def need(self, size: int) -> None:
        if size > len(self.data) - self.pos:
            raise ValueError(f"a value of {size} bytes at byte {self.pos} runs past the end of the file")


def _read_header(path: Path) -> Header | None:
    import gguf

    with path.open("rb") as handle:
        data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(data)
    if cursor.take("<I") != 0x46554747 or cursor.take("<I") not in (2, 3):  # b"GGUF", little-endian
        return None
    num_tensors, num_values = cursor.take("<Q"), cursor.take("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(num_values):
        key, kind = cursor.string(), cursor.take("<I")
        try:
            metadata[key] = cursor.value(kind)
        except UnicodeDecodeError:  # an odd field must not stop the load (its bytes were skipped)
            metadata[key] = None
    infos = []
    cursor.need(num_tensors * 24)  # name length, dimension count, type, offset
    for _ in range(num_tensors):
        name, num_dims = cursor.string(), cursor.take("<I")
        cursor.need(num_dims * 8)
        dims = [cursor.take("<Q") for _ in range(num_dims)]
        infos.append((name, dims, gguf.GGMLQuantizationType(cursor.take("<I")), cursor.take("<Q")))
    alignment = metadata.get("general.alignment", 32)
    start = -(-cursor.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, qtype, offset in infos:
        if name in tensors:
            raise ValueError(f"tensor {name} is listed twice")
        shape = tuple(reversed(dims))  # fastest-first in the file
        elements = int(np.prod(shape, dtype=object))
        if qtype.name in _PLAIN_TENSORS:
            dtype, count, raw_shape = np.dtype(_PLAIN_TENSORS[qtype.name]), elements, shape
        else:
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            if shape and shape[-1] % block:
                raise ValueError(f"tensor {name}: rows of {shape[-1]} are not whole {qtype.name} blocks of {block}")
            dtype, count = np.dtype(np.uint8), elements // block * block_bytes
            raw_shape = (*shape[:-1], shape[-1] // block * block_bytes) if shape else (count,)
        if start + offset + count * dtype.itemsize > len(data):
            raise ValueError(f"tensor {name}'s data runs past the end of the file")
        raw = np.frombuffer(data, dtype, count, start + offset).reshape(raw_shape)
        tensors[name] = GGUFTensor(name=name, type_name=qtype.name, shape=shape, raw=raw)
    return metadata, tensors, data


def _field_value(field: Any) -> Any:
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - an odd field must not stop the load
        return None


def _unreadable_message(path: Path, exc: Exception) -> str:
    """One line saying why the reader gave up: a bad header, or data that stops short."""
    if not path.is_file():
        return f"{path}: cannot open the GGUF file ({exc})"
    with path.open("rb") as handle:
        header = handle.read(8)
    size = path.stat().st_size
    if len(header) < 8 or header[:4] != b"GGUF":
        return f"{path}: not a GGUF file (bad magic or shorter than the 8-byte header; {size} bytes)"
    version = int.from_bytes(header[4:], "little")
    if version not in KNOWN_GGUF_VERSIONS and int.from_bytes(header[4:], "big") not in KNOWN_GGUF_VERSIONS:
        return f"{path}: corrupt GGUF header (version field {version}; GGUF versions are 1-3)"
    # The metadata or the tensor table runs past the end, or an entry is garbage.
    reason = " ".join(str(exc).split()) or type(exc).__name__
    return f"{path}: truncated or corrupt GGUF file ({size} bytes; reading stopped: {reason})"


def is_gguf_file(path: Path) -> bool:
    if not path.is_file():
        return False
    with path.open("rb") as handle:
        return handle.read(4) == b"GGUF"


def _as_rows(shape: tuple[int, ...]) -> tuple[int, int]:
    """A weight's shape as [rows, inputs]: a stack of experts [E, N, K] (ffn_*_exps) as E * N rows."""
    return int(np.prod(shape[:-1])), int(shape[-1])
