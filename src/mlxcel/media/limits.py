"""The media policy (spec C2-C5): sandbox root, SSRF override and payload limits, read once at startup.

`MediaPolicy` is frozen and validated on construction. The CLI builds it with `from_values` from
the values the settings table resolved (flags and their MLXCEL_* mirrors, parsed there once);
`mlxcel.env.media_policy` reads the MLXCEL_* media variables of a mapping through the same
settings. This module knows nothing of the settings table: the table uses its `parse_dir_allowlist`.
"""

from __future__ import annotations

import math
import os
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

ENV_FIELDS = {ENV_ALLOW_PRIVATE: "allow_private_urls", ENV_VIDEO_MAX_FRAMES: "video_max_frames",
              ENV_VIDEO_FPS: "video_fps", ENV_VIDEO_DIR_ALLOWLIST: "video_dir_allowlist"}  # variable -> field
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
    def from_values(cls, **values: Any) -> MediaPolicy:
        """The policy from field values (None = not set: the default); `media_root` may be a path.

        The CLI calls this with the values the settings table resolved from flags and their MLXCEL_*
        mirrors; raises MediaConfigError.
        """
        given = {name: value for name, value in values.items() if value is not None}
        if isinstance(given.get("media_root"), str | os.PathLike):
            given["media_root"] = MediaRoot.open(given["media_root"])
        try:
            return cls(**given)
        except TypeError as exc:
            raise MediaConfigError(f"unknown media option: {exc}") from None


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
