"""The one entry point routes call: media references in, validated bytes out (spec C2-C5).

Counts are checked before any I/O; each reference is then loaded from its source (data: URL,
file under `--media-path`, or SSRF-checked http(s)) under the cap for its kind, and images are
header-checked and decoded. Every refusal is a MediaError naming the part and the rule.
"""

from __future__ import annotations

import asyncio
import enum
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from PIL import Image

from mlxcel.media.data_url import decode_data_url
from mlxcel.media.errors import MediaError, Reason
from mlxcel.media.fetch import Resolver, fetch_remote_media
from mlxcel.media.images import ImageInfo, validate_image
from mlxcel.media.limits import MediaPolicy
from mlxcel.media.paths import read_under_root, require_root, resolve_local_path
from mlxcel.media.video import decode_video_frames

TransportFactory = Callable[[], httpx.AsyncBaseTransport]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


class MediaKind(enum.StrEnum):
    IMAGE = "image"
    AUDIO = "audio"
    VIDEO = "video"


class MediaSource(enum.StrEnum):
    DATA = "data"
    FILE = "file"
    HTTP = "http"


@dataclass(frozen=True)
class MediaRef:
    """One media part of a request: its kind, its URL (data:, file://, bare name, http(s)),
    and for video the block's own sampling rate if it gave one."""

    kind: MediaKind
    url: str
    fps: float | None = None


@dataclass(frozen=True)
class VideoSampling:
    """How a video becomes still frames: frames count toward `--max-images` once sampled."""

    fps: float
    max_frames: int


@dataclass(frozen=True)
class ResolvedMedia:
    """A media part that passed every check. `image` is set for images, `video` and its decoded
    `frames` (RGB, in order) for videos."""

    kind: MediaKind
    source: MediaSource
    data: bytes
    mime_type: str = ""
    image: ImageInfo | None = None
    video: VideoSampling | None = None
    frames: tuple[Image.Image, ...] = ()


async def resolve_media_parts(
    parts: Sequence[MediaRef],
    policy: MediaPolicy,
    *,
    resolver: Resolver | None = None,
    transport_factory: TransportFactory | None = None,
) -> list[ResolvedMedia]:
    """Resolve and validate every media part of one request, in order; raises MediaError.

    The HTTP layer turns a MediaError into a 400 carrying its message and reason code.
    `resolver` and `transport_factory` are passed to the remote fetch (tests inject them).
    """
    check_image_count(sum(part.kind is MediaKind.IMAGE for part in parts), policy)
    loader = _Loader(policy, resolver, transport_factory)
    resolved = []
    for index, part in enumerate(parts):
        try:
            resolved.append(await loader.resolve(part))
        except MediaError as exc:
            where = f"media part {index + 1} ({part.kind.value})"
            raise MediaError(f"{where}: {exc.message}", exc.reason_code) from None
    check_image_count(sum(_num_images(media) for media in resolved), policy)  # C5: video frames count too
    return resolved


def _num_images(media: ResolvedMedia) -> int:
    return 1 if media.kind is MediaKind.IMAGE else len(media.frames)


def check_image_count(num_images: int, policy: MediaPolicy) -> None:
    """Refuse more than `--max-images` images; sampled video frames are counted here too (C5)."""
    if num_images > policy.max_images:
        raise MediaError(
            f"request has {num_images} images (video frames included), over --max-images {policy.max_images}",
            Reason.TOO_MANY_IMAGES,
        )


class _Loader:
    """Per-request state: the policy, the fetch hooks and the audio bytes used so far."""

    def __init__(
        self, policy: MediaPolicy, resolver: Resolver | None, transport_factory: TransportFactory | None
    ) -> None:
        self.policy = policy
        self.resolver = resolver
        self.transport_factory = transport_factory
        self.audio_bytes = 0

    async def resolve(self, part: MediaRef) -> ResolvedMedia:
        if part.kind is MediaKind.IMAGE:
            return await self._image(part)
        if part.kind is MediaKind.AUDIO:
            return await self._audio(part)
        return await self._video(part)

    async def _image(self, part: MediaRef) -> ResolvedMedia:
        cap = self.policy.max_image_payload_bytes
        source, mime, data = await self._load(part, cap, "--max-image-payload-size")
        info = await asyncio.to_thread(validate_image, data, self.policy)
        return ResolvedMedia(MediaKind.IMAGE, source, data, mime, image=info)

    async def _audio(self, part: MediaRef) -> ResolvedMedia:
        remaining = self.policy.max_audio_request_bytes - self.audio_bytes
        if remaining < self.policy.max_audio_clip_bytes:
            cap, limit = remaining, "the per-request audio limit"
        else:
            cap, limit = self.policy.max_audio_clip_bytes, "the per-clip audio limit"
        if cap <= 0:
            raise _over(limit, self.policy.max_audio_request_bytes)
        source, mime, data = await self._load(part, cap, limit)
        self.audio_bytes += len(data)
        return ResolvedMedia(MediaKind.AUDIO, source, data, mime)

    async def _video(self, part: MediaRef) -> ResolvedMedia:
        sampling = VideoSampling(fps=_video_fps(part, self.policy), max_frames=self.policy.video_max_frames)
        source, mime, data = await self._load(part, self.policy.max_video_bytes, "the video size limit")
        frames = await asyncio.to_thread(decode_video_frames, data, sampling.fps, sampling.max_frames, self.policy)
        return ResolvedMedia(MediaKind.VIDEO, source, data, mime, video=sampling, frames=tuple(frames))

    async def _load(self, part: MediaRef, cap: int, limit: str) -> tuple[MediaSource, str, bytes]:
        try:
            return await self._load_from_source(part, cap)
        except MediaError as exc:
            if exc.reason_code is Reason.PAYLOAD_TOO_LARGE:
                raise MediaError(f"{exc.message} ({limit})", exc.reason_code) from None
            raise

    async def _load_from_source(self, part: MediaRef, cap: int) -> tuple[MediaSource, str, bytes]:
        scheme = _scheme(part.url)
        if scheme == "data":
            payload = decode_data_url(part.url, cap)
            return MediaSource.DATA, payload.mime_type, payload.data
        if scheme in ("http", "https"):
            transport = self.transport_factory() if self.transport_factory else None
            data = await fetch_remote_media(
                part.url, self.policy, max_bytes=cap, resolver=self.resolver, transport=transport
            )
            return MediaSource.HTTP, "", data
        if scheme in ("file", ""):
            return MediaSource.FILE, "", await self._read_local(part, cap)
        raise MediaError(
            f"media URL scheme {scheme!r} is not supported; use data:, http(s), file:// or a file name",
            Reason.UNSUPPORTED_SCHEME,
        )

    async def _read_local(self, part: MediaRef, cap: int) -> bytes:
        # Path checks and file reads block, so they run off the event loop.
        root = require_root(self.policy.media_root)
        path = await asyncio.to_thread(resolve_local_path, part.url, root)
        if part.kind is MediaKind.VIDEO:
            check_video_dir(path, self.policy.video_dir_allowlist)
        return await asyncio.to_thread(read_under_root, root, path, cap)


def check_video_dir(path: Path, allowlist: tuple[Path, ...]) -> None:
    """With MLXCEL_VIDEO_DIR_ALLOWLIST set, a local video must also lie inside one of its directories."""
    if allowlist and not any(path == d or d in path.parents for d in allowlist):
        raise MediaError(
            f"local video {path.name!r} is not inside a directory of MLXCEL_VIDEO_DIR_ALLOWLIST",
            Reason.VIDEO_DIR_NOT_ALLOWED,
        )


def _video_fps(part: MediaRef, policy: MediaPolicy) -> float:
    if part.fps is None:
        return policy.video_fps
    fps = part.fps
    if isinstance(fps, bool) or not isinstance(fps, int | float) or not math.isfinite(fps) or fps <= 0:
        raise MediaError(f"video fps must be a finite number above 0, not {fps!r}", Reason.INVALID_MEDIA_PART)
    return float(fps)


def _scheme(url: str) -> str:
    """The URL's scheme in lower case, or "" for a bare file name."""
    if not url:
        raise MediaError("media URL is empty", Reason.INVALID_MEDIA_PART)
    match = _SCHEME.match(url)
    return match.group(1).lower() if match else ""


def _over(limit: str, max_bytes: int) -> MediaError:
    return MediaError(f"audio is over {limit} of {max_bytes} bytes", Reason.PAYLOAD_TOO_LARGE)
