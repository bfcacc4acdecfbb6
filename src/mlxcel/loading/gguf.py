"""Reading GGUF files: metadata as plain Python values, tensors dequantized on demand.

The `gguf` package does the parsing and dequantization; this module turns its reader into
a small, typed view and turns its failures into one clear `ModelLoadError` line.
"""

from __future__ import annotations

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


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    type_name: str  # e.g. "Q4_1"
    shape: tuple[int, ...]  # PyTorch order (rows first), e.g. (out_features, in_features)
    raw: np.ndarray  # the bytes as stored (quantized blocks) or the plain array


class GGUFFile:
    """One GGUF file: `metadata` (key -> Python value) and `tensors` (name -> GGUFTensor)."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        try:
            reader = gguf.GGUFReader(str(self.path))
        except Exception as exc:  # noqa: BLE001 - the gguf package raises many kinds
            raise ModelLoadError(_unreadable_message(self.path, exc)) from exc
        self.metadata = {key: _field_value(field) for key, field in reader.fields.items()}
        self.tensors = {t.name: _tensor(t) for t in reader.tensors}
        self._check_tensor_types()

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """`<architecture>.<key>` from the metadata, e.g. arch_value("block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in PyTorch shape order."""
        import gguf

        tensor = self.tensors[name]
        if tensor.type_name in ("F32", "F16"):
            array = np.asarray(tensor.raw, dtype=np.float32)
        else:
            qtype = gguf.GGMLQuantizationType[tensor.type_name]
            array = gguf.quants.dequantize(tensor.raw, qtype).astype(np.float32, copy=False)
        return array.reshape(tensor.shape)

    def _check_tensor_types(self) -> None:
        for tensor in self.tensors.values():
            if tensor.type_name not in SUPPORTED_TENSOR_TYPES:
                raise ModelLoadError(
                    f"{self.path}: tensor {tensor.name} has type {tensor.type_name}, which is not "
                    f"supported (supported: {', '.join(sorted(SUPPORTED_TENSOR_TYPES))})"
                )


def _tensor(t: Any) -> GGUFTensor:
    # GGUF lists dimensions fastest-first; PyTorch wants them slowest-first.
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return GGUFTensor(name=t.name, type_name=t.tensor_type.name, shape=shape, raw=t.data)


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
