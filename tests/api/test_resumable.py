"""F6 stream buffer on its own (no server): offsets, the byte limit, replacement, delete, expiry,
and what a reader sees. The frames come from a plain async generator standing in for an adapter."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from mlxcel.api.errors import ApiError
from mlxcel.api.replies import StreamReply
from mlxcel.api.resumable import StreamBufferLimits, StreamStore, conversation_id, parse_offset


class Frames:
    """`count` SSE frames, one per `gate` release (so a test can hold the stream open); records
    whether it reached its end and whether on_close ran."""

    def __init__(self, count: int, *, size: int = 10) -> None:
        self.count, self.size = count, size
        self.gate: asyncio.Queue[None] = asyncio.Queue()
        self.is_finished = self.is_closed = False

    async def frames(self) -> AsyncIterator[str]:
        for index in range(self.count):
            await self.gate.get()
            yield f"data: {index:0{self.size - 8}d}\n\n"
            yield ": keepalive\n\n"
        self.is_finished = True

    def release(self, num: int) -> None:
        for _ in range(num):
            self.gate.put_nowait(None)

    def reply(self) -> StreamReply:
        async def close() -> None:
            self.is_closed = True
        return StreamReply(self.frames(), on_close=close)


async def collect(reply: StreamReply) -> list[str]:
    try:
        return [frame async for frame in reply.frames]
    finally:
        await reply.on_close()


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_f6_reader_and_replay_see_the_same_events_without_keepalives() -> None:
    async def scenario() -> None:
        store = StreamStore()
        source = Frames(5)
        first = await store.open(source.reply(), "c1")
        assert first.headers["X-Conversation-Id"] == "c1"
        source.release(5)
        events = await collect(first)
        assert len(events) == 5 and not any(e.startswith(":") for e in events)
        assert await collect(store.replay("c1", 2)) == events[2:]
        assert store.lookup(["c1", "zz"])["data"][0]["status"] == "completed"
        assert store.lookup(["c1", "zz"])["not_found"] == ["zz"]
        assert source.is_finished and source.is_closed
    run(scenario())


def test_f6_a_named_stream_survives_its_reader_an_assigned_one_does_not() -> None:
    async def scenario() -> None:
        store = StreamStore()
        named, assigned = Frames(4), Frames(4)
        named_reply = await store.open(named.reply(), "named")
        assigned_reply = await store.open(assigned.reply(), None)
        cid = assigned_reply.headers["X-Conversation-Id"]
        await named_reply.on_close()  # both readers leave before any event
        await assigned_reply.on_close()
        named.release(4)
        await asyncio.sleep(0.05)
        assert named.is_finished and store.lookup(["named"])["data"][0]["num_events"] == 4
        assert not assigned.is_finished and assigned.is_closed
        assert store.lookup([cid])["data"][0]["status"] == "cancelled"
    run(scenario())


def test_f6_replacing_and_deleting_cancel_before_the_end() -> None:
    async def scenario() -> None:
        store = StreamStore()
        old, new = Frames(10), Frames(1)
        old_reader = await store.open(old.reply(), "same")
        old.release(2)
        await asyncio.sleep(0.01)
        await store.open(new.reply(), "same")
        assert old.is_closed and not old.is_finished
        assert len(await collect(old_reader)) == 2  # the old reader ends where the stream was cut
        await store.delete("same")
        assert new.is_closed and not new.is_finished
        with pytest.raises(ApiError) as caught:
            store.replay("same", 0)
        assert caught.value.status == 404
    run(scenario())


def test_f6_byte_limit_drops_the_oldest_events() -> None:
    async def scenario() -> None:
        store = StreamStore(StreamBufferLimits(max_bytes=35))
        source = Frames(6, size=10)
        reader = asyncio.ensure_future(collect(await store.open(source.reply(), "big")))
        for _ in range(6):  # a reader keeping up gets everything, whatever the limit
            source.release(1)
            await asyncio.sleep(0.01)
        assert len(await reader) == 6
        kept = store.lookup(["big"])["data"][0]
        assert (kept["first_offset"], kept["bytes"], kept["num_events"]) == (3, 30, 6)
        with pytest.raises(ApiError) as caught:
            store.replay("big", 2)
        assert caught.value.status == 410
        assert len(await collect(store.replay("big", 3))) == 3
        with pytest.raises(ApiError):
            store.replay("big", 7)  # past the end of a finished stream
        behind = Frames(6, size=10)
        late = await store.open(behind.reply(), "late")
        behind.release(6)
        await asyncio.sleep(0.05)
        assert await collect(late) == []  # its events were dropped before it read them: it is ended
    run(scenario())


def test_f6_expiry_and_the_count_limit_forget_finished_streams() -> None:
    async def scenario() -> None:
        store = StreamStore(StreamBufferLimits(max_streams=2, ttl_s=60))
        for name in ("a", "b", "c"):
            source = Frames(1)
            source.release(1)
            await collect(await store.open(source.reply(), name))
        await store.open(Frames(1).reply(), "d")  # running: never evicted for the count
        assert sorted(s["conversation_id"] for s in store.lookup(["a", "b", "c", "d"])["data"]) == ["c", "d"]
        await store.sweep(now=asyncio.get_running_loop().time() + 10_000)
        assert store.lookup(["c", "d"])["data"] == []  # d ran with no reader and no event: cancelled
    run(scenario())


def test_f6_header_and_offset_checks() -> None:
    assert conversation_id({}) is None
    assert conversation_id({"x-conversation-id": "abc-1.2:3@x"}) == "abc-1.2:3@x"
    for bad in ("", " a", "a b", "x" * 129, "-a"):
        with pytest.raises(ApiError):
            conversation_id({"x-conversation-id": bad})
    assert parse_offset(None) == 0 and parse_offset("12") == 12
    for bad in ("-1", "1.5", "x", "9" * 19):
        with pytest.raises(ApiError):
            parse_offset(bad)
