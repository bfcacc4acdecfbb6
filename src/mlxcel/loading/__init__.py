"""Resolve a model argument (A2) and read GGUF or safetensors checkpoints into one form."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlxcel.loading.checkpoint import (
    build_model, family_module, gguf_config, gguf_state_dict, hf_config, hf_state_dict,
)
from mlxcel.loading.errors import ModelLoadError
from mlxcel.loading.gguf import GGUFFile, is_gguf_file
from mlxcel.loading.resolve import ResolvedModel, default_model_path, resolve_model

__all__ = ["LoadedModel", "ModelLoadError", "ResolvedModel", "default_model_path", "load_model", "resolve_model"]

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model module with its config, and where its tokenizer and template can be read."""

    model: torch.nn.Module
    config: dict[str, Any]
    path: Path
    gguf: GGUFFile | None  # set for GGUF checkpoints (tokenizer and template live in its metadata)
    model_dir: Path | None  # set for HF-layout folders

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])

    @property
    def supports_batching(self) -> bool:
        return bool(getattr(family_module(self.model_type), "SUPPORTS_BATCHING", True))


def load_model(path: Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Read a GGUF file or an HF-layout folder fully into memory on `device`.

    Raises ModelLoadError with one line that names `path` and what was wrong with it."""
    try:
        return _load(path, device, dtype)
    except ModelLoadError as exc:
        if str(path) in str(exc):
            raise
        raise ModelLoadError(f"{path}: {exc}") from exc


def _load(path: Path, device: torch.device | str, dtype: torch.dtype) -> LoadedModel:
    started = time.monotonic()
    if is_gguf_file(path):
        gguf = GGUFFile(path)
        config = gguf_config(gguf)
        state = gguf_state_dict(gguf, family_module(config["model_type"]), config)
        loaded = LoadedModel(build_model(config, state, device=device, dtype=dtype), config, path, gguf, None)
    elif path.is_dir():
        config = hf_config(path)
        family_module(config["model_type"])  # fail early, naming the supported types
        state = hf_state_dict(path)
        loaded = LoadedModel(build_model(config, state, device=device, dtype=dtype), config, path, None, path)
    else:
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic) and not a model folder")
    log.info("loaded %s weights (%s) from %s in %.1f s", loaded.model_type, dtype, path, time.monotonic() - started)
    return loaded
