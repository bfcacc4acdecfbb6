"""Resolve a model argument (A2) and read GGUF or safetensors checkpoints into one form."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlxcel.loading.checkpoint import (
    GGUFPackedWeights, build_model, family_implementation, family_module, gguf_config, gguf_readers, gguf_state_dict, hf_config, hf_state_dict,
)
from mlxcel.loading.errors import ModelLoadError
from mlxcel.loading.gguf import GGUFFile, is_gguf_file
from mlxcel.loading.quantized import QuantFormat, QuantizedFolder, quant_format
from mlxcel.loading.resolve import ResolvedModel, default_model_path, resolve_model

__all__ = ["Checkpoint", "LoadedModel", "load_weights", "release_load_memory", "open_checkpoint", "ModelLoadError", "ResolvedModel", "default_model_path", "load_model", "resolve_model"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    """An opened checkpoint: config and metadata read (tokenizer, template), weights not yet."""

    path: Path
    config: dict[str, Any]
    gguf: GGUFFile | None  # set for GGUF checkpoints (tokenizer and template live in its metadata)
    model_dir: Path | None  # set for HF-layout folders
    quant: QuantFormat | None = None  # a quantized safetensors folder's format (issue 42)

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])


@dataclass
class LoadedModel:
    """A model module with its config, and where its tokenizer and template can be read."""

    model: torch.nn.Module
    config: dict[str, Any]
    path: Path
    gguf: GGUFFile | None
    model_dir: Path | None
    quant: QuantFormat | None = None  # issue 42: the folder's quantization, kept in its codes on the CPU

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])

    def weights_info(self) -> dict[str, Any]:
        """What the weights are on disk (format, bits): /props, /v1/models and the startup log (issue 42)."""
        if self.quant is not None:
            return {"format": self.quant.method, "mode": self.quant.mode, "bits": self.quant.bits,
                    "group_size": self.quant.group_size, "description": self.quant.describe()}
        if self.gguf is not None:
            stored = self.gguf.weight_format()  # issue 42b: tensor types, bits a weight, bytes of tensor data
            return {**stored, "description": f"GGUF {_gguf_file_type(self.gguf)} ({_type_shares(stored)})"}
        dtype = self.config.get("torch_dtype") or self.config.get("dtype") or "float"
        return {"format": "safetensors", "description": f"safetensors {dtype}"}

    @property
    def implementation(self) -> str:
        """"native" (a family module of ours) or "transformers" (transformers' own modeling code, the fallback)."""
        return family_implementation(self.model_type)

    @property
    def supports_batching(self) -> bool:
        return bool(getattr(family_module(self.model_type), "SUPPORTS_BATCHING", True))


def _type_shares(stored: dict[str, Any]) -> str:
    """e.g. "Q4_K 62%, Q6_K 21%, Q5_0 17% of weights, 4.87 bits a weight"."""
    types = stored["tensor_types"]
    total = sum(entry["weights"] for entry in types.values()) or 1
    shares = ", ".join(f"{name} {100 * entry['weights'] / total:.0f}%" for name, entry in types.items())
    return f"{shares} of weights, {stored['bits_per_weight']:.2f} bits a weight"


def _gguf_file_type(gguf_file: GGUFFile) -> str:
    """The GGUF's `general.file_type` by llama.cpp's name (Q4_K_M, ...), or its number."""
    import gguf

    value = gguf_file.metadata.get("general.file_type")
    try:
        return gguf.LlamaFileType(int(value)).name.removeprefix("MOSTLY_") if value is not None else "(no file type)"
    except ValueError:
        return f"file type {value}"


def open_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint's config and metadata, and check its family is supported (no weights).

    Raises ModelLoadError with one line that names `path` and what was wrong with it."""
    with _naming(path):
        if is_gguf_file(path):
            gguf = GGUFFile(path)
            config = gguf_config(gguf)
            family_module(config["model_type"])
            return Checkpoint(path, config, gguf, None)
        if path.is_dir():
            config = hf_config(path)
            family_module(config["model_type"])  # fail early, naming the supported types
            return Checkpoint(path, config, None, path, quant_format(config))  # an unservable format: one line
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic) and not a model folder")


def load_weights(checkpoint: Checkpoint, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, lazy: bool = False) -> LoadedModel:
    """Materialize an opened checkpoint's weights fully on `device`; `lazy` (A6) only maps the
    file and reads each tensor when the module holding it first runs (loading/lazy.py)."""
    started = time.monotonic()
    path, config = checkpoint.path, checkpoint.config
    with _naming(path):
        folder = QuantizedFolder(path, checkpoint.quant) if checkpoint.quant is not None else None
        state = _lazy_readers(checkpoint, folder) if lazy else _state_dict(checkpoint, folder)
        model = build_model(config, state, device=device, dtype=dtype, lazy=lazy)
        if checkpoint.gguf is not None:  # what the CPU decode rewrite packs as stored (layers/quant.py)
            model.packed_weights = GGUFPackedWeights(checkpoint.gguf, family_module(checkpoint.model_type), config)
        elif folder is not None:  # issue 42: MLX / GPTQ / AWQ / compressed-tensors codes, packed as stored
            model.packed_weights = folder
    loaded = LoadedModel(model, config, path, checkpoint.gguf, checkpoint.model_dir, checkpoint.quant)
    # NOTE: mapped is all this step knows; the caller says when the tensors are read (issue 47: one true line)
    log.info("%s %s weights (%s) from %s in %.1f s; model code: %s", "mapped (no tensor read yet)" if lazy else "read",
             loaded.model_type, dtype, path, time.monotonic() - started, _code_phrase(loaded.implementation))
    return loaded


def _code_phrase(implementation: str) -> str:
    if implementation == "transformers":
        return "transformers' own modeling code with mlxcel's paged attention (no native module: exact, slower)"
    return "native"


def _state_dict(checkpoint: Checkpoint, folder: QuantizedFolder | None) -> dict[str, torch.Tensor]:
    if checkpoint.gguf is not None:
        return gguf_state_dict(checkpoint.gguf, family_module(checkpoint.model_type), checkpoint.config)
    return folder.state_dict() if folder is not None else hf_state_dict(checkpoint.path)


def _lazy_readers(checkpoint: Checkpoint, folder: QuantizedFolder | None) -> dict[str, Any]:
    from mlxcel.loading.lazy import safetensors_readers

    if checkpoint.gguf is not None:
        return gguf_readers(checkpoint.gguf, family_module(checkpoint.model_type), checkpoint.config)
    return folder.readers() if folder is not None else safetensors_readers(checkpoint.path)


def load_model(path: Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               lazy: bool = False) -> LoadedModel:
    """Read a GGUF file or an HF-layout folder into memory on `device` (open + load_weights)."""
    return load_weights(open_checkpoint(path), device=device, dtype=dtype, lazy=lazy)


def release_load_memory(model: torch.nn.Module) -> None:
    """After the load (every tensor read or packed): let go of what only loading needed (issue 42). The
    checkpoint's mapped files (a quantized folder's or a GGUF's readers, `model.packed_weights`, and the lazy
    readers once nothing is pending) are closed, so their pages stop counting in the process's memory, and
    glibc hands the freed unpacking temporaries back to the system (it keeps them otherwise)."""
    if hasattr(model, "packed_weights"):
        del model.packed_weights
    lazy = getattr(model, "lazy_weights", None)
    if lazy is not None and not lazy.num_pending:
        del model.lazy_weights
    gc.collect()
    _trim_heap()


def _trim_heap() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """Put the path in front of a ModelLoadError that does not name it already."""
    try:
        yield
    except ModelLoadError as exc:
        if str(path) in str(exc):
            raise
        raise ModelLoadError(f"{path}: {exc}") from exc
