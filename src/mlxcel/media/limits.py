"""The media policy (spec C2-C5): sandbox root, SSRF override and payload limits, read once at startup.

`MediaPolicy` is frozen and validated on construction; `MediaPolicy.from_env` combines the
MLXCEL_* variables with explicit CLI values (a CLI value wins over its environment mirror).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcel.media.errors import MediaConfigError
from mlxcel.media.paths import MediaRoot

MIB = 1 << 20

ENV_ALLOW_PRIVATE = "MLXCEL_ALLOW_PRIVATE_MEDIA_URLS"
ENV_VIDEO_MAX_FRAMES = "MLXCEL_VIDEO_MAX_FRAMES"
ENV_VIDEO_FPS = "MLXCEL_VIDEO_FPS"
ENV_VIDEO_DIR_ALLOWLIST = "MLXCEL_VIDEO_DIR_ALLOWLIST"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})
_COUNT_FIELDS = (
    "max_image_payload_bytes",
    "max_images",
    "max_image_width",
    "max_image_height",
    "max_image_pixels",
    "max_audio_clip_bytes",
    "max_audio_request_bytes",
    "max_video_bytes",
    "video_max_frames",
)


@dataclass(frozen=True)
class MediaPolicy:
    """Everything the media layer enforces. Defaults are the server's defaults.

    Byte limits apply to the encoded payload (after base64 decoding for data: URLs); pixel
    limits are read from the image header before any decode. Video frames count toward
    `max_images` once they are sampled.
    """

    media_root: MediaRoot | None = None
    allow_private_urls: bool = False
    max_image_payload_bytes: int = 20 * MIB
    max_images: int = 32
    max_image_width: int = 16384
    max_image_height: int = 16384
    max_image_pixels: int = 40_000_000
    max_audio_clip_bytes: int = 25 * MIB
    max_audio_request_bytes: int = 50 * MIB
    max_video_bytes: int = 256 * MIB
    video_max_frames: int = 16
    video_fps: float = 2.0
    video_dir_allowlist: tuple[Path, ...] = field(default_factory=tuple)
    fetch_timeout_s: float = 10.0
    max_redirects: int = 5

    def __post_init__(self) -> None:
        for name in ("video_fps", "fetch_timeout_s"):
            _require_positive_float(name, getattr(self, name))
        for name in _COUNT_FIELDS:
            _require_int_at_least(name, getattr(self, name), 1)
        _require_int_at_least("max_redirects", self.max_redirects, 0)

    @classmethod
    def from_env(cls, env: Mapping[str, str], **cli: Any) -> MediaPolicy:
        """Build the policy from MLXCEL_* variables plus CLI values; raises MediaConfigError.

        `env` is the startup snapshot (`mlxcel.env.Environment.raw`, read once by the CLI), never
        os.environ itself. `cli` takes field names (`media_root` may be a path string); a value
        of None means the flag was not given.
        """
        values: dict[str, Any] = _env_values(env)
        values.update({name: value for name, value in cli.items() if value is not None})
        if isinstance(values.get("media_root"), str | os.PathLike):
            values["media_root"] = MediaRoot.open(values["media_root"])
        try:
            return cls(**values)
        except TypeError as exc:
            raise MediaConfigError(f"unknown media option: {exc}") from None


def _env_values(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if ENV_ALLOW_PRIVATE in env:
        values["allow_private_urls"] = parse_bool(ENV_ALLOW_PRIVATE, env[ENV_ALLOW_PRIVATE])
    if ENV_VIDEO_MAX_FRAMES in env:
        values["video_max_frames"] = parse_positive_int(ENV_VIDEO_MAX_FRAMES, env[ENV_VIDEO_MAX_FRAMES])
    if ENV_VIDEO_FPS in env:
        values["video_fps"] = parse_positive_float(ENV_VIDEO_FPS, env[ENV_VIDEO_FPS])
    if ENV_VIDEO_DIR_ALLOWLIST in env:
        values["video_dir_allowlist"] = parse_dir_allowlist(
            ENV_VIDEO_DIR_ALLOWLIST, env[ENV_VIDEO_DIR_ALLOWLIST]
        )
    return values


def parse_bool(name: str, text: str) -> bool:
    """Read an on/off variable; anything but 1/true/yes/on or 0/false/no/off/empty is an error."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise MediaConfigError(f"{name} must be 1 or 0 (or true/false), not {text!r}")


def parse_positive_int(name: str, text: str) -> int:
    """Read an integer >= 1."""
    try:
        value = int(text.strip())
    except ValueError:
        raise MediaConfigError(f"{name} must be a whole number, not {text!r}") from None
    _require_int_at_least(name, value, 1)
    return value


def parse_positive_float(name: str, text: str) -> float:
    """Read a finite number > 0."""
    try:
        value = float(text.strip())
    except ValueError:
        raise MediaConfigError(f"{name} must be a number, not {text!r}") from None
    _require_positive_float(name, value)
    return value


def parse_dir_allowlist(name: str, text: str) -> tuple[Path, ...]:
    """Read a list of absolute, existing directories separated by ':' or ','; canonicalised."""
    entries = [entry.strip() for entry in text.replace(",", os.pathsep).split(os.pathsep)]
    directories: list[Path] = []
    for entry in filter(None, entries):
        path = Path(entry)
        if not path.is_absolute():
            raise MediaConfigError(f"{name} entry {entry!r} is not an absolute path")
        if not path.is_dir():
            raise MediaConfigError(f"{name} entry {entry!r} is not an existing directory")
        directories.append(path.resolve(strict=True))
    return tuple(directories)


def _require_int_at_least(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MediaConfigError(f"{name} must be a whole number, not {value!r}")
    if value < minimum:
        raise MediaConfigError(f"{name} must be at least {minimum}, not {value}")


def _require_positive_float(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MediaConfigError(f"{name} must be a number, not {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise MediaConfigError(f"{name} must be a finite number above 0, not {value!r}")
