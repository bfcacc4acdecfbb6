"""Resolve a model argument (A2) and read GGUF or safetensors checkpoints into one form."""

from __future__ import annotations

import contextlib
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
from mlxcel.loading.resolve import ResolvedModel, default_model_path, resolve_model

__all__ = ["Checkpoint", "LoadedModel", "load_weights", "open_checkpoint", "ModelLoadError", "ResolvedModel", "default_model_path", "describe_weight_format", "load_model", "resident_bytes", "resolve_model"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    """An opened checkpoint: config and metadata read (tokenizer, template), weights not yet."""

    path: Path
    config: dict[str, Any]
    gguf: GGUFFile | None  # set for GGUF checkpoints (tokenizer and template live in its metadata)
    model_dir: Path | None  # set for HF-layout folders

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

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])

    @property
    def implementation(self) -> str:
        """"native" (a family module of ours) or "transformers" (transformers' own modeling code, the fallback)."""
        return family_implementation(self.model_type)

    def weight_format(self) -> dict[str, Any]:
        """The checkpoint's weight format (a GGUF's tensor types and bits a weight, `GGUFFile.weight_format`) and
        the bytes of the model's tensors resident now (after the CPU decode rewrite: as packed), issue 42."""
        stored = self.gguf.weight_format() if self.gguf is not None else {"format": "safetensors"}
        return {**stored, "resident_bytes": resident_bytes(self.model)}

    @property
    def supports_batching(self) -> bool:
        return bool(getattr(family_module(self.model_type), "SUPPORTS_BATCHING", True))


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers that hold data (not meta: a lazy tensor not yet read),
    each storage once (tied or viewed tensors share one)."""
    storages: dict[int, int] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def describe_weight_format(summary: dict[str, Any]) -> str:
    """One log phrase: e.g. "GGUF: Q4_K 88%, Q6_K 11%, F32 1% of weights, 4.87 bits a weight, 940.4 MiB in the
    file; 1012.0 MiB resident"."""
    resident = f"{summary['resident_bytes'] / 2**20:.1f} MiB resident"
    types = summary.get("tensor_types")
    if not types:
        return f"{summary['format']}; {resident}"
    total = sum(entry["weights"] for entry in types.values()) or 1
    shares = ", ".join(f"{name} {100 * entry['weights'] / total:.0f}%" for name, entry in types.items())
    return (f"{summary['format'].upper()}: {shares} of weights, {summary['bits_per_weight']:.2f} bits a weight, "
            f"{summary['file_bytes'] / 2**20:.1f} MiB in the file; {resident}")


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
            return Checkpoint(path, config, None, path)
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic) and not a model folder")


def load_weights(checkpoint: Checkpoint, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, lazy: bool = False) -> LoadedModel:
    """Materialize an opened checkpoint's weights fully on `device`; `lazy` (A6) only maps the
    file and reads each tensor when the module holding it first runs (loading/lazy.py)."""
    started = time.monotonic()
    path, config = checkpoint.path, checkpoint.config
    with _naming(path):
        state = _lazy_readers(checkpoint) if lazy else _state_dict(checkpoint)
        model = build_model(config, state, device=device, dtype=dtype, lazy=lazy)
        if checkpoint.gguf is not None:  # what the CPU decode rewrite packs as stored (layers/quant.py)
            model.packed_weights = GGUFPackedWeights(checkpoint.gguf, family_module(checkpoint.model_type), config)
    loaded = LoadedModel(model, config, path, checkpoint.gguf, checkpoint.model_dir)
    # NOTE: mapped is all this step knows; the caller says when the tensors are read (issue 47: one true line)
    log.info("%s %s weights (%s) from %s in %.1f s; model code: %s", "mapped (no tensor read yet)" if lazy else "read",
             loaded.model_type, dtype, path, time.monotonic() - started, _code_phrase(loaded.implementation))
    return loaded


def _code_phrase(implementation: str) -> str:
    if implementation == "transformers":
        return "transformers' own modeling code with mlxcel's paged attention (no native module: exact, slower)"
    return "native"


def _state_dict(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    if checkpoint.gguf is not None:
        return gguf_state_dict(checkpoint.gguf, family_module(checkpoint.model_type), checkpoint.config)
    return hf_state_dict(checkpoint.path)


def _lazy_readers(checkpoint: Checkpoint) -> dict[str, Any]:
    from mlxcel.loading.lazy import safetensors_readers

    if checkpoint.gguf is not None:
        return gguf_readers(checkpoint.gguf, family_module(checkpoint.model_type), checkpoint.config)
    return safetensors_readers(checkpoint.path)


def load_model(path: Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               lazy: bool = False) -> LoadedModel:
    """Read a GGUF file or an HF-layout folder into memory on `device` (open + load_weights)."""
    return load_weights(open_checkpoint(path), device=device, dtype=dtype, lazy=lazy)


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """Put the path in front of a ModelLoadError that does not name it already."""
    try:
        yield
    except ModelLoadError as exc:
        if str(path) in str(exc):
            raise
        raise ModelLoadError(f"{path}: {exc}") from exc
