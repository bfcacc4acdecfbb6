"""Server-sent events framing, and the keepalive comment sent while a stream is silent (A9).

A comment line (starting with ':') is ignored by every SSE parser, so clients never see it;
it only resets proxy idle timers during a long prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
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

    The pending `__anext__` is kept across timeouts (never cancelled by the timer), so no frame
    is lost; closing this generator cancels it and closes `frames`.
    """
    iterator = aiter(frames)
    pending: asyncio.Task[str] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(iterator))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield keepalive_frame
                continue
            try:
                frame = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield frame
    finally:
        await _cancel(pending)
        with contextlib.suppress(Exception):
            await iterator.aclose()  # type: ignore[attr-defined]


async def _cancel(task: asyncio.Task[str] | None) -> None:
    if task is None or task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
        await task
