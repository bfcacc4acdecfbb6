"""Reading GGUF files: metadata as plain Python values, tensors dequantized on demand.

The `gguf` package does the parsing and dequantization; this module turns its reader into
a small, typed view and turns its failures into one clear `ModelLoadError` line.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlxcel.loading.errors import ModelLoadError

# Tensor types the loader accepts (the `gguf` package dequantizes each of them).
SUPPORTED_TENSOR_TYPES = frozenset(
    {
        "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K",
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

    def int8_levels(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
        """A tensor stored as int8 codes times a scale per group (Q8_0, Q5_0: groups of 32; Q6_K: of 16) as
        its codes (int8 [N, K]) and scales (float32 [N, K / group]): w = code * scale, the values
        `dequantize` gives, and for Q6_K its superblocks' d (float32 [N, K / 256, 1]), of which the scales
        are integer multiples; None for other types (issue 27: such a weight is kept as stored)."""
        tensor = self.tensors[name]
        group_scales = _INT8_SCALES.get(tensor.type_name)
        if group_scales is None or len(tensor.shape) < 2:
            return None
        import gguf

        rows, cols = _as_rows(tensor.shape)
        qtype, block_bytes = gguf.GGMLQuantizationType[tensor.type_name], _INT8_BLOCK_BYTES[tensor.type_name]
        codes = np.empty((rows, cols), dtype=np.int8)
        scales: list[np.ndarray] = []
        units: list[np.ndarray] = []
        try:
            raw = np.asarray(tensor.raw).view(np.uint8).reshape(rows, -1)
            step = max(1, DEQUANTIZE_CHUNK // raw.shape[1])
            # In slices of rows: the float temporaries stay a slice's size (Qwen2.5-1.5B's Q6_K head
            # whole: several float32 copies of 0.9 GB at once, +1 GB peak RSS at load).
            for start in range(0, rows, step):
                part = raw[start:start + step]
                scale = group_scales(part.reshape(-1, block_bytes)).reshape(len(part), -1)  # [n, K / group]
                values = gguf.quants.dequantize(part, qtype).reshape(len(part), scale.shape[1], -1)
                with np.errstate(divide="ignore", invalid="ignore"):
                    part_codes = np.rint(values / scale[..., None])
                part_codes = np.where(scale[..., None] != 0, part_codes, 0).clip(-128, 127)
                codes[start:start + step] = part_codes.reshape(len(part), cols)
                scales.append(scale.astype(np.float32))
                if tensor.type_name == "Q6_K":
                    units.append(_f16(part.reshape(-1, block_bytes), 208).reshape(len(part), -1, 1))
        finally:
            self.release_pages()
        return codes, np.concatenate(scales), np.concatenate(units) if units else None

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


def _q6_k_scales(blocks: np.ndarray) -> np.ndarray:
    """256 weights a block in 16 groups of 16: w = d * sc_j * q (int8 sc_j at byte 192, float16 d at 208)."""
    return _f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)  # [blocks, 16]


# Scale per group of the int8-code types (Q8_0: d * q; Q5_0: d * (q - 16)), from their raw blocks.
_INT8_SCALES = {"Q8_0": lambda blocks: _f16(blocks, 0), "Q5_0": lambda blocks: _f16(blocks, 0), "Q6_K": _q6_k_scales}
_INT8_BLOCK_BYTES = {"Q8_0": 34, "Q5_0": 22, "Q6_K": 210}
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
