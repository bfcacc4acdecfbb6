"""Encoder checkpoints (spec I): what kind an HF-layout folder is (embedding, cross-encoder), and
the folder (config.json + safetensors) into an encoder family's model, for the embedding and
rerank workers.

The family module is found by the folder's `model_type` (importlib, as every family is); it
offers `encoder(args, state)` and, for cross-encoders, `classifier(args, state)`, each returning
the model and the state it loads. Every failure is one ModelLoadError naming the folder.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import torch
from torch import nn

from mlxcel.loading.checkpoint import hf_state_dict
from mlxcel.loading.errors import ModelLoadError

ModuleT = TypeVar("ModuleT", bound=nn.Module)
CROSS_ENCODER_FAMILY = "bert"  # the only cross-encoder family so far


def load_model(folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """The encoder of an HF-layout folder (BertModel or any Bert*For* checkpoint)."""
    config = read_config(folder)
    family = encoder_family(folder, config.get("model_type", ""))
    return _build(family.encoder, family, config, folder, device, dtype)


def load_classifier(
    folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> nn.Module:
    """An HF-layout BertForSequenceClassification folder (a cross-encoder)."""
    config = read_config(folder)
    if config.get("model_type") != CROSS_ENCODER_FAMILY:
        path = Path(folder) / "config.json"
        raise ModelLoadError(f"{path}: model_type is {config.get('model_type')!r}, not {CROSS_ENCODER_FAMILY!r}")
    family = importlib.import_module(f"mlxcel.models.{CROSS_ENCODER_FAMILY}")
    return _build(family.classifier, family, config, folder, device, dtype)


def is_embedding_checkpoint(folder: str | Path) -> bool:
    """A sentence-transformers folder or a bare encoder (starts an embedding-only process)."""
    folder = Path(folder)
    if (folder / "modules.json").is_file():
        return True
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    # A bare encoder's architecture is "<Family>Model" (BertModel), not "...ForCausalLM".
    return any(str(name).endswith("Model") and "For" not in str(name) for name in config.get("architectures") or [])


def is_rerank_checkpoint(folder: str | Path) -> bool:
    """A 1-label *ForSequenceClassification checkpoint (starts a rerank-only process)."""
    config = _config_or_empty(folder)
    architectures = config.get("architectures") or []
    is_classifier = any(str(name).endswith("ForSequenceClassification") for name in architectures)
    num_labels = len(config["id2label"]) if "id2label" in config else config.get("num_labels", 2)
    return is_classifier and num_labels == 1


def _config_or_empty(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def read_config(folder: str | Path) -> dict[str, Any]:
    """`folder/config.json` as a dict."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read the model config ({exc})") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: the model config is not a JSON object")
    return config


def encoder_family(folder: str | Path, model_type: str) -> ModuleType:
    """The family module of `model_type`, which must offer an encoder."""
    try:
        family = importlib.import_module(f"mlxcel.models.{model_type}")
    except ModuleNotFoundError:
        raise ModelLoadError(f"{folder}: model_type {model_type!r} has no encoder implementation") from None
    if not hasattr(family, "encoder"):
        raise ModelLoadError(f"{folder}: model_type {model_type!r} is not an encoder family")
    return family


def _build(
    make: Callable[[Any, dict[str, torch.Tensor]], tuple[ModuleT, dict[str, torch.Tensor]]], family: ModuleType,
    config: dict[str, Any], folder: str | Path, device: str | torch.device, dtype: torch.dtype,
) -> ModuleT:
    try:
        args = family.ModelArgs.from_dict(config)
    except ValueError as exc:  # a setting the family refuses
        raise ModelLoadError(str(exc)) from exc
    model, weights = make(args, hf_state_dict(Path(folder)))
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise ModelLoadError(
            f"{folder}: checkpoint does not match the {config.get('model_type')} model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    model.load_state_dict(weights)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
