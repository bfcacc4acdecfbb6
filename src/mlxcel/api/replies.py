"""Framework-neutral replies that adapters return and the server turns into HTTP responses."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class JsonReply:
    body: Any
    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StreamReply:
    """An SSE stream: every frame is a complete event (keepalive comments already inserted).

    Everything that can fail with a status code (validation, template, queue, context) has
    already been checked when a StreamReply exists. The server awaits `on_close` once the
    response is over, however it ended (even if `frames` was never started), to free the slots.
    """

    frames: AsyncIterator[str]
    on_close: Callable[[], Awaitable[None]]
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BytesReply:
    """A whole non-JSON body: transcript text, subtitles, an encoded audio file."""

    body: bytes
    media_type: str
    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ByteStreamReply:
    """A non-SSE body sent as it is produced (speech audio); `on_close` runs however it ended."""

    chunks: AsyncIterator[bytes]
    media_type: str
    on_close: Callable[[], Awaitable[None]]
    headers: Mapping[str, str] = field(default_factory=dict)


Reply = JsonReply | StreamReply | BytesReply | ByteStreamReply
