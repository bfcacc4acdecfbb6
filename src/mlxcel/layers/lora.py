"""LoRA adapters applied beside the base weights, never merged into them (F8).

A rewrite of a finished model (DESIGN rule 3): `apply_adapters` wraps each targeted projection
(q/k/v/o/gate/up/down) in a `LoraLinear`, whose output is

    y = base(x) + sum_a scale[row, a] * (alpha_a / r_a) * B_a(A_a(x))

The scales are not constants: they are one tensor [num_tokens, num_adapters] per step, which
the runner (prefill) and the decode step put on the model's `LoraRows` before running it, so
each row of a batch can use its own adapters and scales, and the compiled decode layer reads
them as an input (a CUDA graph copies them into its static buffer). The wrapped base module
may be a plain `nn.Linear` or the CPU decode rewrite's quantized / fused stand-ins.

Adapters are read in PEFT's layout: `adapter_config.json` (r, lora_alpha, use_rslora,
target_modules) and `adapter_model.safetensors` (`...<module>.lora_A.weight` [r, in],
`...<module>.lora_B.weight` [out, r]).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mlxcel.layers.quant import Step, linear

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY_RE = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be read or does not fit the model; startup is refused (exit 2)."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter as read from disk: per module path, (A [r, in], B [out, r] times alpha/r)."""

    path: Path
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def load_adapter(path: Path, scale: float = 1.0) -> LoraAdapter:
    """Read a PEFT LoRA adapter folder; AdapterError names the path and what is wrong."""
    config = _read_config(path)
    tensors = _read_tensors(path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        match = _KEY_RE.match(key)
        if match is None:
            raise AdapterError(f"{path}: tensor {key!r} is not a LoRA A/B weight (only {', '.join(TARGET_MODULES)} "
                               "projections are supported)")
        pairs.setdefault(match["module"], {})[match["part"]] = value
    weights = {module: _scaled_pair(path, module, parts, config) for module, parts in pairs.items()}
    if not weights:
        raise AdapterError(f"{path}: {WEIGHTS_FILE} holds no LoRA weights")
    return LoraAdapter(path, float(scale), weights)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{path}: cannot read {CONFIG_FILE} ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path}: {CONFIG_FILE} is not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{path}: peft_type {config['peft_type']!r} is not LORA")
    for flag in ("use_dora", "fan_in_fan_out", "lora_bias"):
        if config.get(flag):
            raise AdapterError(f"{path}: {flag} adapters are not supported")
    if config.get("modules_to_save") or config.get("alpha_pattern"):
        raise AdapterError(f"{path}: modules_to_save and alpha_pattern are not supported")
    if not isinstance(config.get("r"), int) or not isinstance(config.get("lora_alpha"), (int, float)):
        raise AdapterError(f"{path}: {CONFIG_FILE} needs integer r and numeric lora_alpha")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted({str(t).rsplit(".", 1)[-1] for t in targets} - set(TARGET_MODULES))
        if unknown:
            raise AdapterError(f"{path}: target_modules {unknown} are not supported (supported: "
                               f"{', '.join(TARGET_MODULES)})")
    return config


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path / WEIGHTS_FILE))
    except Exception as exc:  # noqa: BLE001 - safetensors raises several kinds
        raise AdapterError(f"{path}: cannot read {WEIGHTS_FILE} ({exc})") from None


def _scaled_pair(path: Path, module: str, parts: dict[str, torch.Tensor],
                 config: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B * alpha / r) for one module, after checking the pair's shapes agree."""
    if set(parts) != {"A", "B"}:
        raise AdapterError(f"{path}: {module} has lora_{''.join(parts)} but not both lora_A and lora_B")
    if module.rsplit(".", 1)[-1] not in TARGET_MODULES:
        raise AdapterError(f"{path}: module {module} is not one of {', '.join(TARGET_MODULES)}")
    a, b = parts["A"].float(), parts["B"].float()
    rank = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
        raise AdapterError(f"{path}: {module} lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not pair up")
    if rank != config["r"] and not config.get("rank_pattern"):
        raise AdapterError(f"{path}: {module} has rank {rank} but {CONFIG_FILE} says r={config['r']}")
    alpha = float(config["lora_alpha"])
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return a, b * scaling


@dataclass
class LoraRows:
    """The current step's scales [num_tokens, num_adapters], read by every LoraLinear of a model."""

    num_adapters: int
    scales: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 0))
    paths: tuple[str, ...] = ()  # each adapter's folder, by id: what a slot file's LoRA KV was computed with (F12)

    def set_rows(self, scales: torch.Tensor) -> None:
        self.scales = scales


class LoraLinear(nn.Module):
    """A base projection plus the low-rank updates of the adapters that target it."""

    def __init__(self, base: nn.Module, rows: LoraRows, parts: list[tuple[int, torch.Tensor, torch.Tensor]],
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base = base
        self._rows = [rows]  # a list: shared by every LoraLinear, not a submodule
        # NOTE: on the CPU the update is computed in float64: BLAS takes other kernels for a few rows than
        # for many, so in float32 a row's update (and a prefix hit's first token) would depend on how many
        # rows its call had; float64's differences vanish when the update is rounded back.
        work = torch.float64 if torch.device(device).type == "cpu" else dtype
        # Every adapter's A stacked: [sum r, in]; each B side by side: [out, sum r].
        self.register_buffer("lora_a", torch.cat([a for _, a, _ in parts]).to(device, work))
        self.register_buffer("lora_b", torch.cat([b for _, _, b in parts], dim=1).to(device, work))
        columns = [index for index, a, _ in parts for _ in range(a.shape[0])]
        self.register_buffer("columns", torch.tensor(columns, dtype=torch.long, device=device))  # rank -> adapter

    def forward(self, x: torch.Tensor, step: Step | None = None) -> torch.Tensor:
        y = linear(self.base, x, step)
        scales = self._rows[0].scales.to(self.lora_a.dtype).index_select(1, self.columns)  # [T or 1, sum r]
        low = F.linear(x.to(self.lora_a.dtype), self.lora_a) * scales  # [T, sum r]
        return y + F.linear(low, self.lora_b).to(y.dtype)


def in_out_features(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) of a projection: nn.Linear, QuantLinear or a fused group's FusedOutput."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    fused = getattr(module, "_fused", None)
    if fused:
        return fused[0].linear.in_features, fused[0].sizes[module.index]
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return int(module.in_features), int(module.out_features)
    return None


def apply_adapters(model: nn.Module, adapters: Sequence[LoraAdapter], *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> LoraRows:
    """Wrap every projection the adapters target; AdapterError if one does not fit the model.

    Checks everything before changing anything, so a refused adapter leaves the model as it was."""
    modules = dict(model.named_modules())
    param = next(model.parameters(), None)
    if param is None:
        param = next(model.buffers())
    device = torch.device(device) if device is not None else param.device  # lazy weights sit on meta
    dtype = dtype or param.dtype
    targets: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for index, adapter in enumerate(adapters):
        for name, (a, b) in adapter.weights.items():
            _check_fits(adapter, name, a, b, modules.get(name))
            targets.setdefault(name, []).append((index, a, b))
    rows = LoraRows(len(adapters), torch.tensor([[a.scale for a in adapters]], dtype=torch.float32, device=device),
                    tuple(str(a.path) for a in adapters))
    for name, parts in targets.items():
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name]
        setattr(parent, child, LoraLinear(getattr(parent, child), rows, parts, dtype, device))
    model.lora_rows = rows  # the runner and the decode step set each step's scales here
    return rows


def _check_fits(adapter: LoraAdapter, name: str, a: torch.Tensor, b: torch.Tensor, module: nn.Module | None) -> None:
    if module is None:
        raise AdapterError(f"{adapter.path}: targets {name}, which this model does not have")
    features = in_out_features(module)
    if features is None:
        raise AdapterError(f"{adapter.path}: {name} is not a linear projection in this model")
    if (a.shape[1], b.shape[0]) != features:
        raise AdapterError(f"{adapter.path}: {name} adapter maps {a.shape[1]} -> {b.shape[0]} features, "
                           f"the model's {features[0]} -> {features[1]}")


def model_lora_rows(model: nn.Module) -> LoraRows | None:
    return getattr(model, "lora_rows", None)


def token_scales(rows: LoraRows, per_seq: Sequence[tuple[float, ...]], counts: Sequence[int],
                 device: torch.device) -> torch.Tensor:
    """[sum(counts), num_adapters]: each sequence's scales repeated over its tokens this step."""
    table = torch.tensor([_full(rows, s) for s in per_seq], dtype=torch.float32).reshape(len(per_seq), rows.num_adapters)
    return table.repeat_interleave(torch.tensor(counts, dtype=torch.long), dim=0).to(device)


def _full(rows: LoraRows, scales: tuple[float, ...]) -> list[float]:
    # A request built before adapters existed (warmup, tests) carries no scales: the base model.
    return list(scales) if scales else [0.0] * rows.num_adapters
