"""SSE framing and the keepalive comment (A9)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from mlxcel.api.sse import DONE_FRAME, KEEPALIVE_FRAME, sse_frame, with_keepalive


async def slow_frames(delays: list[float], closed: list[bool]) -> AsyncIterator[str]:
    try:
        for i, delay in enumerate(delays):
            await asyncio.sleep(delay)
            yield sse_frame({"i": i})
    finally:
        closed.append(True)


def collect(delays: list[float], interval: float) -> tuple[list[str], list[bool]]:
    closed: list[bool] = []

    async def main() -> list[str]:
        return [frame async for frame in with_keepalive(slow_frames(delays, closed), interval)]
    return asyncio.run(main()), closed


def test_sse_frame_format() -> None:
    assert sse_frame({"a": "é"}) == 'data: {"a":"é"}\n\n'
    assert sse_frame({"x": 1}, event="message_start") == 'event: message_start\ndata: {"x":1}\n\n'
    assert DONE_FRAME == "data: [DONE]\n\n" and KEEPALIVE_FRAME.startswith(":")


def test_a9_keepalive_only_while_silent_and_no_frame_lost() -> None:
    frames, closed = collect([0.0, 0.25, 0.0], interval=0.1)
    data = [f for f in frames if f != KEEPALIVE_FRAME]
    assert data == [sse_frame({"i": 0}), sse_frame({"i": 1}), sse_frame({"i": 2})]
    assert 1 <= frames.count(KEEPALIVE_FRAME) <= 3
    assert frames.index(KEEPALIVE_FRAME) == 1  # between frame 0 and the late frame 1
    assert closed == [True]


def test_a9_no_keepalive_when_frames_flow() -> None:
    frames, _ = collect([0.0, 0.0, 0.0], interval=5.0)
    assert KEEPALIVE_FRAME not in frames and len(frames) == 3


def test_closing_early_closes_the_source() -> None:
    closed: list[bool] = []

    async def main() -> None:
        stream = with_keepalive(slow_frames([0.0, 10.0], closed), 0.05)
        assert await anext(stream) == sse_frame({"i": 0})
        assert await anext(stream) == KEEPALIVE_FRAME
        await stream.aclose()  # the pending 10 s frame is cancelled, the source closed
    asyncio.run(asyncio.wait_for(main(), 5))
    assert closed == [True]


def test_an_error_in_the_source_reaches_the_reader_after_its_frames() -> None:
    async def failing() -> AsyncIterator[str]:
        yield sse_frame({"i": 0})
        raise ValueError("the source failed")

    async def main() -> list[str]:
        frames = []
        try:
            async for frame in with_keepalive(failing(), 5.0):
                frames.append(frame)
        except ValueError as exc:
            frames.append(str(exc))
        return frames
    assert asyncio.run(main()) == [sse_frame({"i": 0}), "the source failed"]
