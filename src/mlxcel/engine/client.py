"""The API layer's view of the engine: submit a Request, iterate its TokenEvents, abort, stats."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from mlxcel.engine.loop import EngineCore
from mlxcel.types import EngineError, EngineStats, FinishReason, PrefixCacheReset, Request, TokenEvent


class DecodeTimeoutError(EngineError):
    """No token arrived for --decode-timeout seconds after decoding started (A8)."""


class Mailbox:
    """Carries TokenEvents from the engine thread into one asyncio loop (issue 25).

    The engine hands over a whole step's events in a row; the first one wakes the loop and the
    rest ride along, so a step with 64 streams costs one wake-up (one self-pipe write and one GIL
    hand-off), not 64. Each request's events keep their order."""

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()
    _by_loop_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[TokenEvent], TokenEvent]] = []

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Mailbox:
        with cls._by_loop_lock:
            mailbox = cls._by_loop.get(loop)
            if mailbox is None:
                mailbox = cls._by_loop[loop] = cls(loop)
            return mailbox

    def post(self, queue: asyncio.Queue[TokenEvent], event: TokenEvent) -> None:
        """Called on the engine thread."""
        with self._lock:
            self._pending.append((queue, event))
            if len(self._pending) > 1:
                return  # a wake-up is already on its way
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody is left to read these events
            with self._lock:
                self._pending.clear()

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, event in pending:
            queue.put_nowait(event)


class RequestStream:
    """Async iterator over one request's TokenEvents; closing it early aborts the request.

    The decode timeout (A8) is one timer a stream, re-armed lazily when it fires, not a timeout around each
    wait: a token costs no timer (issue 25)."""

    def __init__(self, core: EngineCore, request: Request, decode_timeout_s: float) -> None:
        self._core = core
        self.request_id = request.request_id
        self._queue: asyncio.Queue[TokenEvent | None] = asyncio.Queue()  # None: the decode timeout fired
        self._decode_timeout_s = decode_timeout_s
        self._is_decoding = False
        self._is_done = False
        self._loop = asyncio.get_running_loop()
        self._last_event_at = 0.0  # loop time the latest event was taken, once decoding
        self._timer: asyncio.TimerHandle | None = None
        mailbox = Mailbox.of(self._loop)
        queue = self._queue
        core.submit(request, lambda event: mailbox.post(queue, event))

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._is_done:
            raise StopAsyncIteration
        event = await self._queue.get()
        if event is None:
            await self.aclose()
            raise DecodeTimeoutError(f"no token for {self._decode_timeout_s:.0f} s; request aborted")
        if event.finish_reason is not None:
            self._is_done = True
            self._stop_timer()
        elif event.progress is None:  # prompt progress is still prefill: the decode timeout waits (A8)
            self._last_event_at = self._loop.time()
            if not self._is_decoding:
                self._is_decoding = True
                self._timer = self._loop.call_at(self._last_event_at + self._decode_timeout_s, self._check_timeout)
        return event

    def _check_timeout(self) -> None:
        """The timer: no event taken for the whole timeout and none waiting means the engine stalled;
        otherwise it is set again for the new deadline."""
        if self._is_done:
            return
        now, deadline = self._loop.time(), self._last_event_at + self._decode_timeout_s
        if not self._queue.empty():  # events wait for a slow reader: the engine is not the one stalled
            deadline = now + self._decode_timeout_s
        elif now >= deadline:
            self._timer = None
            self._queue.put_nowait(None)
            return
        self._timer = self._loop.call_at(deadline, self._check_timeout)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def aclose(self) -> None:
        """Abort the request unless it already finished (client disconnect, stop string hit)."""
        self._stop_timer()
        if not self._is_done:
            self._is_done = True
            self._core.abort(self.request_id)


class EngineClient:
    """Thread-safe front of an EngineCore for asyncio code."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def submit(self, request: Request) -> RequestStream:
        """Queue a request; raises QueueFullError / ContextOverflowError / EngineShutdownError at once."""
        return RequestStream(self.core, request, self.core.config.decode_timeout_s)

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    RUNTIME_FIELDS = frozenset({"max_queue_depth", "decode_timeout_s", "n_predict", "seed"})

    def reconfigure(self, **changes: Any) -> None:
        """Change the engine settings that may change at run time (F9); the next submit sees them."""
        unknown = changes.keys() - self.RUNTIME_FIELDS
        if unknown:
            raise ValueError(f"not changeable at run time: {', '.join(sorted(unknown))}")
        self.core.config = replace(self.core.config, **changes)  # one attribute store: atomic for readers

    @property
    def max_requests(self) -> int:
        """Requests the engine holds at once (slots + waiting places): more can never be admitted."""
        return self.core.config.max_num_seqs + self.core.config.max_queue_depth

    def stats(self) -> EngineStats:
        return self.core.stats()

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread between steps and await its result (an in-process core only)."""
        return await asyncio.wrap_future(self.core.call(fn))

    async def command(self, name: str, *args: Any) -> Any:
        """One of the core's named commands, in its process or another's (issue 25)."""
        return await asyncio.wrap_future(self.core.command(name, *args))

    async def save_slot(self, slot_id: int, filename: str) -> Any:
        return await self.command("save_slot", slot_id, filename)

    async def restore_slot(self, slot_id: int, filename: str) -> Any:
        return await self.command("restore_slot", slot_id, filename)

    async def erase_slot(self, slot_id: int) -> int:
        return await self.command("erase_slot", slot_id)

    async def reset_prefix_cache(self) -> PrefixCacheReset:
        return await self.command("reset_prefix_cache")

    async def generate(self, request: Request) -> AsyncIterator[TokenEvent]:
        """Convenience: iterate a request to its end (aborting it if the caller stops early)."""
        stream = self.submit(request)
        try:
            async for event in stream:
                yield event
        finally:
            await stream.aclose()


def is_finished(event: TokenEvent) -> bool:
    return event.finish_reason is not None and event.finish_reason is not FinishReason.ERROR
