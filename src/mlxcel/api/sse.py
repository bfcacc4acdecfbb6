"""Server-sent events framing, and the keepalive comment sent while a stream is silent (A9).

A comment line (starting with ':') is ignored by every SSE parser, so clients never see it;
it only resets proxy idle timers during a long prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

KEEPALIVE_INTERVAL_S = 15.0
KEEPALIVE_FRAME = ": keepalive\n\n"
DONE_FRAME = "data: [DONE]\n\n"


def to_json(value: Any) -> str:
    """Compact JSON that keeps non-ASCII text as is."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def sse_frame(data: Any, event: str | None = None) -> str:
    """One SSE event: `data: <json>` (with `event:` first when named), ended by a blank line."""
    payload = data if isinstance(data, str) else to_json(data)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


async def with_keepalive(frames: AsyncIterator[str], interval_s: float = KEEPALIVE_INTERVAL_S, *,
                         keepalive_frame: str = KEEPALIVE_FRAME) -> AsyncIterator[str]:
    """Yield `frames`, inserting `keepalive_frame` (a comment by default; Anthropic sends a ping
    event) whenever none came for `interval_s`.

    One task pulls `frames` for the stream's whole life and hands each over through a one-place queue (so a
    slow client still holds the source back), and one timer, set again only when it fires, adds the
    keepalives: a frame costs no task and no timer (issue 25: this runs once per token of every stream).
    Closing this generator cancels the pull, so no frame is lost before it and `frames` is closed.
    """
    loop = asyncio.get_running_loop()
    iterator = aiter(frames)
    handoff: asyncio.Queue[str | _Ended] = asyncio.Queue(maxsize=1)
    last_frame_at = loop.time()

    async def pull() -> None:
        try:
            async for frame in iterator:
                await handoff.put(frame)
            await handoff.put(_Ended(None))
        except Exception as exc:  # noqa: BLE001 - the reader re-raises it
            await handoff.put(_Ended(exc))

    def tick() -> None:
        nonlocal timer
        now, deadline = loop.time(), last_frame_at + interval_s
        if now >= deadline:
            if handoff.empty():  # (else a frame is waiting for a slow reader: no keepalive needed)
                handoff.put_nowait(keepalive_frame)
            deadline = now + interval_s
        timer = loop.call_at(deadline, tick)

    puller = asyncio.ensure_future(pull())
    timer = loop.call_at(last_frame_at + interval_s, tick)
    try:
        while not isinstance(item := await handoff.get(), _Ended):
            if item is not keepalive_frame:
                last_frame_at = loop.time()
            yield item
        if item.error is not None:
            raise item.error
    finally:
        timer.cancel()
        await _cancel(puller)
        with contextlib.suppress(Exception):
            await iterator.aclose()  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class _Ended:
    """The end of `with_keepalive`'s source: its exception, if it raised one."""

    error: Exception | None


async def _cancel(task: asyncio.Future[None]) -> None:
    if task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
