"""A checkpoint's own sampling defaults (issue 46), by llama-server's field names.

vLLM applies a folder's `generation_config.json` (temperature, top_k, top_p, min_p,
repetition_penalty); llama-server reads a GGUF's `general.sampling.*` keys. Either is the layer
between the server's flags and llama-server's built-in defaults (api/context.SamplingDefaults).
A value of the wrong type or out of range is left out, logged, never fatal.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                          "repetition_penalty": "repeat_penalty"}
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
             "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_last_n": "repeat_last_n", "general.sampling.penalty_repeat": "repeat_penalty"}
# what each field accepts (the settings table's ranges for --temp, --top-k, ...)
_IS_VALID: dict[str, Callable[[float], bool]] = {
    "temperature": lambda v: v >= 0, "top_k": lambda v: v == int(v), "top_p": lambda v: 0 < v <= 1,
    "min_p": lambda v: 0 <= v <= 1, "repeat_last_n": lambda v: v == int(v) and v >= -1,
    "repeat_penalty": lambda v: v > 0,
}
_INTEGERS = frozenset({"top_k", "repeat_last_n"})


def checkpoint_sampling(gguf_metadata: Mapping[str, Any] | None, model_dir: Path | None) -> dict[str, Any]:
    """The sampling defaults the checkpoint declares: its GGUF keys, else its generation_config.json."""
    if gguf_metadata is not None:
        return _read(gguf_metadata, GGUF_KEYS, "GGUF")
    if model_dir is None or not (model_dir / "generation_config.json").is_file():
        return {}
    try:
        config = json.loads((model_dir / "generation_config.json").read_text())
    except (OSError, ValueError) as exc:
        log.warning("generation_config.json unreadable, its sampling defaults not used: %s", exc)
        return {}
    return _read(config, GENERATION_CONFIG_KEYS, "generation_config.json") if isinstance(config, dict) else {}


def _read(source: Mapping[str, Any], keys: Mapping[str, str], where: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, name in keys.items():
        value = source.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not _IS_VALID[name](value):
            log.warning("%s: %s = %r is not a valid %s; left out", where, key, value, name)
            continue
        # GGUF stores float32: 0.95 reads as 0.949999988..., shown (and used) as the 0.95 it was written as
        found[name] = int(value) if name in _INTEGERS else float(f"{value:.7g}")
    if found:
        log.info("sampling defaults from the checkpoint's %s: %s", where, found)
    return found


__all__ = ["checkpoint_sampling"]
