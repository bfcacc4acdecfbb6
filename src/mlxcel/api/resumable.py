"""Resumable streams (F6): streamed chat completions and responses kept in a bounded buffer.

Every such stream gets a conversation id (the client's `X-Conversation-Id`, or one assigned and
returned in that header). A producer task drives the adapter's frames into a `StreamSession`;
each HTTP connection (the first one, or `GET /v1/stream?offset=N`) only reads the buffer, so a
client that reconnects with the number of events it has gets every later event exactly once.

A stream the client named keeps generating when its connection drops (and is counted in the
metrics when it ends); one with an assigned id is cancelled with its connection. `DELETE
/v1/stream`, a new stream with the same id and the buffer's expiry cancel a running stream
before its end, so it is not counted (the adapter counts only streams that reach their end).
Memory: each stream keeps at most `max_bytes` of events (older events are dropped first);
finished streams are kept `ttl_s` after their last event and at most `max_streams` of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mlxcel.api.errors import ApiError, invalid_request
from mlxcel.api.replies import StreamReply
from mlxcel.api.sse import KEEPALIVE_INTERVAL_S, with_keepalive

log = logging.getLogger(__name__)

CONVERSATION_HEADER = "X-Conversation-Id"
MAX_LOOKUP_IDS = 256
_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
Status = Literal["running", "completed", "cancelled", "failed"]


@dataclass(frozen=True, slots=True)
class StreamBufferLimits:
    """--stream-buffer-streams, --stream-buffer-bytes, --stream-buffer-ttl."""

    max_streams: int = 64  # finished streams kept (running ones are bounded by the engine queue)
    max_bytes: int = 4 << 20  # events kept per stream; the oldest go first
    ttl_s: float = 300.0  # how long a stream is kept after its last event (a running one: with no reader)
    keepalive_s: float = KEEPALIVE_INTERVAL_S

    def __post_init__(self) -> None:
        if self.max_streams < 1 or self.max_bytes < 1 or self.ttl_s <= 0:
            raise ValueError("stream buffer limits must be positive: --stream-buffer-streams, "
                             "--stream-buffer-bytes, --stream-buffer-ttl")


def conversation_id(headers: Mapping[str, str]) -> str | None:
    """The client's `X-Conversation-Id`, checked (400 when malformed); None when not sent."""
    value = headers.get(CONVERSATION_HEADER.lower())
    if value is None:
        return None
    return checked_id(value, CONVERSATION_HEADER)


def checked_id(value: Any, what: str) -> str:
    if not isinstance(value, str) or _ID_PATTERN.fullmatch(value) is None:
        raise invalid_request(f"{what} must be 1-128 characters of letters, digits and . _ : @ - "
                              "(starting with a letter or digit)")
    return value


def stream_not_found(cid: str) -> ApiError:
    return ApiError(404, f"no stream with conversation id '{cid}' is kept", "not_found_error", code=404,
                    extra={"param": "conversation_id"})


class StreamSession:
    """One stream's events (SSE frames, keepalive comments left out) and its producer task."""

    def __init__(self, cid: str, *, is_resumable: bool, max_bytes: int) -> None:
        self.conversation_id = cid
        self.is_resumable = is_resumable  # the client named it: a dropped connection does not cancel it
        self.created_at = int(time.time())
        self.updated = time.monotonic()
        self.status: Status = "running"
        self.first_offset = 0  # the offset of _events[0]; > 0 once old events were dropped
        self.num_bytes = 0
        self.num_readers = 0
        self._max_bytes = max_bytes
        self._events: list[str] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._reply: StreamReply | None = None

    @property
    def end_offset(self) -> int:
        """The number of events produced so far (the offset the next one will have)."""
        return self.first_offset + len(self._events)

    @property
    def is_running(self) -> bool:
        return self.status == "running"

    def start(self, reply: StreamReply) -> None:
        self._reply = reply
        self._task = asyncio.get_running_loop().create_task(self._produce(reply),
                                                            name=f"stream {self.conversation_id}")

    async def _end(self) -> None:
        """Once, however the stream ended: close the frames and free the engine request."""
        if self.status == "running":
            self.status = "cancelled"
        self._notify()
        reply, self._reply = self._reply, None
        if reply is None:
            return
        with contextlib.suppress(Exception):
            await reply.frames.aclose()  # type: ignore[attr-defined]
        await reply.on_close()  # frees the engine request (aborts it when cancelled)

    async def _produce(self, reply: StreamReply) -> None:
        try:
            async for frame in reply.frames:
                if not frame.startswith(":"):  # keepalive comments are per connection, never buffered
                    self._append(frame)
            self.status = "completed"
        except Exception:  # noqa: BLE001 - an adapter bug: logged, the stream ends
            log.exception("stream %s failed", self.conversation_id)
            self.status = "failed"
        finally:
            await self._end()

    def _append(self, frame: str) -> None:
        self._events.append(frame)
        self.num_bytes += _size(frame)
        num_dropped = 0
        while self.num_bytes > self._max_bytes and num_dropped < len(self._events) - 1:
            self.num_bytes -= _size(self._events[num_dropped])
            num_dropped += 1
        if num_dropped:  # NOTE: the newest event is always kept, even over the limit
            del self._events[:num_dropped]
            self.first_offset += num_dropped
        self._notify()

    def _notify(self) -> None:
        self.updated = time.monotonic()
        self._wakeup.set()
        self._wakeup = asyncio.Event()

    async def cancel(self) -> None:
        """Stop a running stream before its end (its engine request is aborted); waits for that."""
        task = self._task
        if task is None or task.done() or not self.is_running:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(task)
        await self._end()  # NOTE: a task cancelled before its first step never ran its finally

    async def events_from(self, offset: int) -> AsyncIterator[str]:
        """Events from `offset` on, then the live ones until the stream ends."""
        self.num_readers += 1
        try:
            while offset >= self.first_offset:
                if offset < self.end_offset:
                    yield self._events[offset - self.first_offset]
                    offset += 1
                    continue
                if not self.is_running:
                    return
                await self._wakeup.wait()
            # A reader slower than the buffer: what it missed is gone, so it is ended here.
            log.warning("stream %s: a reader at offset %d fell behind the buffer", self.conversation_id, offset)
        finally:
            self.num_readers -= 1
            self.updated = time.monotonic()

    def describe(self) -> dict[str, Any]:
        return {"object": "stream", "conversation_id": self.conversation_id, "status": self.status,
                "resumable": self.is_resumable, "num_events": self.end_offset, "first_offset": self.first_offset,
                "bytes": self.num_bytes, "num_readers": self.num_readers, "created_at": self.created_at}


class StreamStore:
    """The server's resumable streams by conversation id (one event loop: no locks needed)."""

    def __init__(self, limits: StreamBufferLimits | None = None) -> None:
        self.limits = limits or StreamBufferLimits()
        self._sessions: dict[str, StreamSession] = {}
        self._sweeper: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._sessions)

    async def open(self, reply: StreamReply, cid: str | None) -> StreamReply:
        """Buffer `reply` under `cid` (None: a new assigned id) and return the first reader's reply.

        A running stream with the same id is cancelled first (the new request replaces it)."""
        old = self._sessions.pop(cid, None) if cid is not None else None
        if old is not None:
            await old.cancel()
        session = StreamSession(cid or f"conv_{uuid.uuid4().hex}", is_resumable=cid is not None,
                                max_bytes=self.limits.max_bytes)
        self._sessions[session.conversation_id] = session
        session.start(reply)
        self._evict_finished()
        self._start_sweeper()

        async def close() -> None:
            if not session.is_resumable:
                await session.cancel()  # an assigned id: the client leaving ends the stream

        return self._reader(session, 0, close, reply.headers)

    def replay(self, cid: str, offset: int) -> StreamReply:
        """GET /v1/stream: the events of `cid` from `offset`, then live until the end."""
        session = self._get(cid)
        if offset < session.first_offset:
            raise ApiError(410, f"events before offset {session.first_offset} of '{cid}' are no longer kept "
                                "(--stream-buffer-bytes)", "invalid_request_error", code=410,
                           extra={"param": "offset"})
        if offset > session.end_offset and not session.is_running:
            raise invalid_request(f"offset {offset} is past the end of stream '{cid}' "
                                  f"({session.end_offset} events)")
        return self._reader(session, offset, _nothing, {})

    async def delete(self, cid: str) -> dict[str, Any]:
        """DELETE /v1/stream: cancel the stream if it runs, and forget it."""
        session = self._get(cid)
        self._sessions.pop(cid, None)
        await session.cancel()
        return {"object": "stream.deleted", "conversation_id": cid, "deleted": True}

    def lookup(self, cids: Sequence[str]) -> dict[str, Any]:
        """POST /v1/streams/lookup: what is kept of each id (unknown ids are listed apart)."""
        found = [self._sessions[cid].describe() for cid in cids if cid in self._sessions]
        missing = [cid for cid in cids if cid not in self._sessions]
        return {"object": "list", "data": found, "not_found": missing}

    def _get(self, cid: str) -> StreamSession:
        session = self._sessions.get(cid)
        if session is None:
            raise stream_not_found(cid)
        return session

    def _reader(self, session: StreamSession, offset: int, on_close: Any, headers: Mapping[str, str]) -> StreamReply:
        frames = with_keepalive(session.events_from(offset), self.limits.keepalive_s)
        return StreamReply(frames, on_close=on_close,
                           headers={**headers, CONVERSATION_HEADER: session.conversation_id})

    def _evict_finished(self) -> None:
        finished = sorted((s for s in self._sessions.values() if not s.is_running), key=lambda s: s.updated)
        num_over = len(self._sessions) - self.limits.max_streams
        for session in finished[:max(num_over, 0)]:
            self._sessions.pop(session.conversation_id, None)

    async def sweep(self, now: float | None = None) -> None:
        """Forget streams past their age limit; a running one nobody reads is cancelled (expiry)."""
        now = time.monotonic() if now is None else now
        for session in list(self._sessions.values()):
            if now - session.updated <= self.limits.ttl_s or (session.is_running and session.num_readers):
                continue
            self._sessions.pop(session.conversation_id, None)
            await session.cancel()

    def _start_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_while_kept(), name="stream sweeper")

    async def _sweep_while_kept(self) -> None:
        while self._sessions:
            await asyncio.sleep(min(self.limits.ttl_s / 2, 5.0))
            await self.sweep()


async def _nothing() -> None:
    return None


def _size(frame: str) -> int:
    return len(frame.encode("utf-8"))


def parse_offset(text: str | None) -> int:
    """The `offset` query parameter: a count of events already received (default 0)."""
    if text is None or text == "":
        return 0
    if not text.isdigit() or len(text) > 18:
        raise invalid_request("offset must be a non-negative integer (the number of events already received)")
    return int(text)


def parse_lookup_ids(body: Any) -> list[str]:
    """The body of POST /v1/streams/lookup: {"conversation_ids": [...]} (at most 256)."""
    ids = body.get("conversation_ids") if isinstance(body, dict) else None
    if not isinstance(ids, list):
        raise invalid_request("the body must be an object with a 'conversation_ids' array of strings")
    if len(ids) > MAX_LOOKUP_IDS:
        raise invalid_request(f"at most {MAX_LOOKUP_IDS} conversation_ids per lookup, not {len(ids)}")
    return [checked_id(cid, "each conversation id") for cid in ids]
