"""The ASGI layer every HTTP request passes first: auth (C1), body size (D1), socket timeouts (A8).

Order matters (D1): a missing key is a 401 before anything about the body is said; then a
body over --max-body-size is a 413 (from Content-Length at once, or while it streams in);
reading the body and writing the response each get the --timeout deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Generator, Sequence
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxcel.api.errors import ApiError, body_too_large, error_body, invalid_api_key
from mlxcel.server.auth import is_valid_key, presented_key


class BodyTooLargeError(ApiError):
    """Raised from `receive` when a streamed body passes the limit; rendered as 413."""


class ReadTimeoutError(ApiError):
    """The client sent no body bytes for --timeout seconds."""


class Gate:
    def __init__(self, app: ASGIApp, *, api_keys: Sequence[str], public_paths: Collection[str],
                 max_body_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.api_keys = tuple(api_keys)
        self.public_paths = frozenset(public_paths)
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._check(scope)
        if error is not None:
            await JSONResponse(error_body(error), error.status, headers=error.headers)(scope, receive, send)
            return
        await self.app(scope, self._guarded_receive(receive), self._timed_send(send))

    def _check(self, scope: Scope) -> ApiError | None:
        if self.api_keys and scope["path"] not in self.public_paths:
            if not is_valid_key(presented_key(scope["headers"]), self.api_keys):
                return invalid_api_key()
        length = _content_length(scope)
        if length is not None and length > self.max_body_bytes:
            return body_too_large(self.max_body_bytes)
        return None

    def _guarded_receive(self, receive: Receive) -> Receive:
        received = 0
        is_body_done = False

        async def guarded() -> Message:
            nonlocal received, is_body_done
            if is_body_done:  # after the body, receive() only waits for a disconnect: no deadline
                return await receive()
            try:
                async with asyncio.timeout(self.timeout_s):
                    message = await receive()
            except TimeoutError:
                raise ReadTimeoutError(408, f"no request body bytes for {self.timeout_s:g} s (--timeout)",
                                       code=408) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                is_body_done = not message.get("more_body", False)
                if received > self.max_body_bytes:
                    raise BodyTooLargeError(413, body_too_large(self.max_body_bytes).message, code=413)
            return message

        return guarded

    def _timed_send(self, send: Send) -> Send:
        timeout_s = self.timeout_s

        async def timed(message: Message) -> None:
            # A write that the socket takes at once needs no deadline: an `asyncio.timeout` around each
            # one cost ~4.5 us a streamed token (a timer armed and cancelled; issue 25: about 4 % of the
            # API loop at 256 streams on an H200). So the write runs its first step bare, and only one
            # that waits (a client that stops reading) waits under --timeout: a stuck client cannot
            # pin a slot.
            steps = send(message).__await__()
            try:
                awaited = steps.send(None)
            except StopIteration:
                return
            async with asyncio.timeout(timeout_s):
                await _Rest(steps, awaited)

        return timed


class _Rest:
    """The rest of a coroutine whose first step already ran and yielded `awaited` (what the event loop
    waits on): awaiting this passes the loop's answers and any exception (a cancellation) on to it."""

    __slots__ = ("_steps", "_awaited")

    def __init__(self, steps: Generator[Any, Any, None], awaited: Any) -> None:
        self._steps, self._awaited = steps, awaited

    def __await__(self) -> Generator[Any, Any, None]:
        steps, awaited = self._steps, self._awaited
        while True:
            try:
                answer = yield awaited
            except GeneratorExit:
                steps.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - thrown into the write, which may handle it
                try:
                    awaited = steps.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    awaited = steps.send(answer)
                except StopIteration:
                    return


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
