"""Turning API replies and errors into Starlette responses."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from mlxcel.api.errors import ApiError, Protocol, error_body
from mlxcel.api.replies import ByteStreamReply, BytesReply, JsonReply, Reply, StreamReply

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SseResponse(StreamingResponse):
    """An SSE stream that always runs `on_close` when it ends: finished, disconnected or failed."""

    def __init__(self, reply: StreamReply) -> None:
        super().__init__(reply.frames, media_type="text/event-stream", headers={**SSE_HEADERS, **reply.headers})
        self._on_close: Callable[[], Awaitable[None]] = reply.on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


class ByteStreamResponse(StreamingResponse):
    """A streamed non-SSE body (speech audio) that always runs `on_close` when it ends."""

    def __init__(self, reply: ByteStreamReply) -> None:
        super().__init__(reply.chunks, media_type=reply.media_type, headers=dict(reply.headers))
        self._on_close: Callable[[], Awaitable[None]] = reply.on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


def to_response(reply: Reply) -> Response:
    if isinstance(reply, StreamReply):
        return SseResponse(reply)
    if isinstance(reply, BytesReply):
        return Response(reply.body, reply.status, headers=dict(reply.headers), media_type=reply.media_type)
    if isinstance(reply, ByteStreamReply):
        return ByteStreamResponse(reply)
    assert isinstance(reply, JsonReply)
    return JSONResponse(reply.body, reply.status, headers=dict(reply.headers))


def error_response(error: ApiError, protocol: Protocol = "openai") -> JSONResponse:
    return JSONResponse(error_body(error, protocol), error.status, headers=error.headers)


def internal_error(exc: BaseException, protocol: Protocol = "openai", where: str = "") -> JSONResponse:
    """A real server bug (never bad input): logged with its traceback (and the route), answered 500."""
    log.error("unhandled error%s: %r", f" in {where}" if where else "", exc, exc_info=exc)
    return error_response(ApiError(500, "internal server error; see the server log", "server_error", code=500),
                          protocol)
