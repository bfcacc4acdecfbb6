"""Every environment variable mlxcel reads, in one typed table, read once at startup.

`Environment.read()` takes a snapshot of `os.environ` (or any mapping, for tests) and parses
each variable of `ENV_VARS` with its type; a malformed value refuses startup with a message
naming the variable. `LLAMA_ARG_*` flag mirrors (A10) are kept raw here: the CLI's option
table knows their types and applies them only where the flag itself was not given.
Nothing reads `os.environ` at import time (DESIGN.md anti-patterns).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LLAMA_ARG_PREFIX = "LLAMA_ARG_"
_TRUE = frozenset({"1", "true", "yes", "on", "enabled"})
_FALSE = frozenset({"0", "false", "no", "off", "disabled", ""})


class EnvError(ValueError):
    """A variable has a value its type cannot hold; startup is refused."""


def parse_bool(text: str) -> bool:
    """llama.cpp's spellings: 1/true/yes/on/enabled and 0/false/no/off/disabled."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected true or false, not {text!r}")


def _parse_path(text: str) -> Path:
    return Path(text).expanduser()


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One variable: its name, how to parse it, its default, what it does (for --help)."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    help: str


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("LLAMA_API_KEY", str, None, "API key, as --api-key (C1)"),
    EnvVar("MLXCEL_DEFAULT_ORG", str, "mlx-community", "owner used for bare model names (A2)"),
    EnvVar("MLXCEL_MODELS_DIR", _parse_path, None, "model store, as --models-dir (A2)"),
    EnvVar("MLXCEL_WEIGHT_MATERIALIZATION", str, "eager", "eager or lazy weight loading (A6)"),
    EnvVar("MLXCEL_QUANTIZE", str, "auto", "CPU decode matmuls, as --quantize: auto or off"),
    EnvVar("MLXCEL_KV_CACHE_MEMORY", str, None, "KV pool cap, as --kv-cache-memory (e.g. 512M)"),
    EnvVar("MLXCEL_DECODE_STEP", str, "auto", "how decode steps run, as --decode-step"),
    EnvVar("MLXCEL_NO_COMPILE", parse_bool, False, "run decode steps eagerly, as --no-compile"),
    EnvVar("MLXCEL_ALLOW_PRIVATE_MEDIA_URLS", parse_bool, False, "skip the media address checks (C3)"),
    EnvVar("MLXCEL_VIDEO_MAX_FRAMES", int, 16, "frames kept per video block (C5)"),
    EnvVar("MLXCEL_VIDEO_FPS", float, 2.0, "video sampling rate when a block gives none (C5)"),
    EnvVar("MLXCEL_VIDEO_DIR_ALLOWLIST", str, None, "folders local video paths may come from (C5)"),
    EnvVar("MLXCEL_ANTHROPIC_PIN_BILLING_STAMP", parse_bool, True, "pin Claude Code's billing stamp (E2)"),
    EnvVar("MLXCEL_REQUEST_MEMORY_BUDGET", str, None, "lower the request memory budget, e.g. 24G (O)"),
    EnvVar("MLXCEL_LOOP_DETECTION", str, None, "operator override of the n-gram repeat guard (P)"),
    EnvVar("MLXCEL_REASONING_ECHO_MAX_BYTES", int, 16 << 20, "reasoning echo store size; 0 disables (Q)"),
    EnvVar("MLXCEL_IMAGE_MODEL", str, None, "image generation checkpoint, as --image-model (J)"),
    EnvVar("MLXCEL_RESPONSES_DB", _parse_path, None, "stored Responses database, as --responses-db (F2)"),
    EnvVar("MLXCEL_STREAM_BUFFER_STREAMS", int, 64, "finished resumable streams kept, as --stream-buffer-streams (F6)"),
    EnvVar("MLXCEL_STREAM_BUFFER_BYTES", str, None, "events kept per resumable stream, as --stream-buffer-bytes (F6)"),
    EnvVar("MLXCEL_STREAM_BUFFER_TTL", float, 300.0, "seconds a resumable stream is kept, as --stream-buffer-ttl (F6)"),
    EnvVar("MLXCEL_AUDIO_QUEUE_DEPTH", int, 8, "audio requests waiting before 503, as --audio-queue-depth (G)"),
    EnvVar("MLXCEL_AUDIO_REQUEST_TIMEOUT_SECS", float, 120.0, "audio deadline before 504 (G)"),
    EnvVar("MLXCEL_AUDIO_MAX_UPLOAD_SIZE", str, None, "largest audio upload, as --audio-max-upload-size (G)"),
    EnvVar("MLXCEL_AUDIO_MAX_DURATION_SECS", float, 600.0, "longest audio transcribed (G)"),
    EnvVar("MLXCEL_AUDIO_BEAM_SIZE", int, 5, "Whisper beam size, as --audio-beam-size (G)"),
    EnvVar("MLXCEL_REALTIME_STT", str, None, "the realtime cascade's Whisper, as --realtime-stt (H)"),
    EnvVar("MLXCEL_REALTIME_TTS", str, None, "the realtime cascade's voice, as --realtime-tts (H)"),
)
_BY_NAME = {var.name: var for var in ENV_VARS}


@dataclass(frozen=True, slots=True)
class Environment:
    """A parsed snapshot of the process environment."""

    values: Mapping[str, Any] = field(default_factory=dict)  # every ENV_VARS name, parsed or default
    llama_args: Mapping[str, str] = field(default_factory=dict)  # LLAMA_ARG_* as given
    raw: Mapping[str, str] = field(default_factory=dict)  # the whole snapshot, for MediaPolicy.from_env

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> Environment:
        """Parse `environ` (default os.environ) once; raises EnvError naming a bad variable."""
        raw = dict(os.environ if environ is None else environ)
        values = {var.name: _parse_var(var, raw.get(var.name)) for var in ENV_VARS}
        llama_args = {k: v for k, v in raw.items() if k.startswith(LLAMA_ARG_PREFIX)}
        return cls(values, llama_args, raw)

    def __getitem__(self, name: str) -> Any:
        if name not in _BY_NAME:
            raise KeyError(f"{name} is not in mlxcel.env.ENV_VARS")
        return self.values.get(name, _BY_NAME[name].default)


def _parse_var(var: EnvVar, text: str | None) -> Any:
    if text is None or (text == "" and var.parse is not str):
        return var.default
    try:
        return var.parse(text)
    except ValueError as exc:
        raise EnvError(f"environment variable {var.name}={text!r} is invalid: {exc}") from None
