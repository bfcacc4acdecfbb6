"""What the hybrid recurrent families share at the checkpoint: their global modules' own names."""

from __future__ import annotations

from typing import Any


def rename_prefixes(weights: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """The checkpoint's entries with each prefix in `names` replaced (e.g. Nemotron-H's
    `model.embeddings.` -> `model.embed_tokens.`); values (tensors or lazy readers) as they were."""
    out = {}
    for key, value in weights.items():
        old = next((p for p in names if key.startswith(p)), None)
        out[key if old is None else names[old] + key[len(old):]] = value
    return out


def config_float(value: Any) -> float:
    """A float of config.json; transformers 5 writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def time_step_limit(config: dict[str, Any]) -> tuple[float, float]:
    """Mamba-2's dt clamp (`time_step_limit`), (0, inf) when unset."""
    low, high = config.get("time_step_limit") or (0.0, float("inf"))
    return config_float(low), config_float(high)
