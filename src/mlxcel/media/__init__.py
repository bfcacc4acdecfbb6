"""Media input security (spec C2-C5): sandboxed local files, SSRF-safe remote fetch, payload limits.

Routes build `MediaRef`s from request parts and call `resolve_media_parts`; a `MediaError`
becomes a 400 naming its `reason_code`. The policy (`MediaPolicy`) is built once at startup
from the values the settings table resolved (`MediaPolicy.from_values`; `mlxcel.env.media_policy`
from an environment snapshot).
"""

from __future__ import annotations

from mlxcel.media.addresses import is_blocked_address, parse_host
from mlxcel.media.errors import MediaConfigError, MediaError, Reason
from mlxcel.media.fetch import Resolver, default_resolver, fetch_remote_media
from mlxcel.media.images import ImageInfo, validate_image
from mlxcel.media.limits import MediaPolicy
from mlxcel.media.paths import MediaRoot, read_local_media, resolve_local_path
from mlxcel.media.resolve import (
    MediaKind,
    MediaRef,
    MediaSource,
    ResolvedMedia,
    VideoSampling,
    check_image_count,
    resolve_media_parts,
)

__all__ = [
    "ImageInfo",
    "MediaConfigError",
    "MediaError",
    "MediaKind",
    "MediaPolicy",
    "MediaRef",
    "MediaRoot",
    "MediaSource",
    "Reason",
    "ResolvedMedia",
    "Resolver",
    "VideoSampling",
    "check_image_count",
    "default_resolver",
    "fetch_remote_media",
    "is_blocked_address",
    "parse_host",
    "read_local_media",
    "resolve_local_path",
    "resolve_media_parts",
    "validate_image",
]
