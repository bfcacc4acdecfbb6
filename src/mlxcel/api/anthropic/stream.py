"""Anthropic content blocks and the Messages event stream (E1).

`ContentBlocks` turns the protocol-neutral output events of chat/events.py (answer text,
reasoning, tool calls) into Anthropic blocks: `text` (text_delta), `thinking` (thinking_delta)
and `tool_use` (input_json_delta). Streaming sends the block events as they happen; a
non-streaming reply reads `content()` from the same object, so both always agree.

A stream is, in order: message_start, ping, content_block_start, content_block_delta...
content_block_stop, message_delta (stop_reason, usage), message_stop; a `ping` event also
goes out whenever the stream is silent for the keepalive interval (A9).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from mlxcel.api.anthropic.conversation import tool_use_input
from mlxcel.api.errors import ApiError, error_body
from mlxcel.api.sse import sse_frame, to_json, with_keepalive
from mlxcel.chat.events import (
    ContentDelta, OutputEvent, ReasoningDelta, ToolCallArguments, ToolCallEnd, ToolCallStart,
)  # fmt: skip

PING = {"type": "ping"}
PING_FRAME = f"event: ping\ndata: {to_json(PING)}\n\n"

Payload = dict[str, Any]


def event_frame(payload: Payload) -> str:
    """One SSE event named by its payload's `type`, as Anthropic sends them."""
    return sse_frame(payload, event=payload["type"])


class ContentBlocks:
    """The reply's content blocks, built from output events; at most one block is open at a time."""

    def __init__(self) -> None:
        self.blocks: list[Payload] = []
        self._open: int | None = None
        self._tool_blocks: dict[int, int] = {}  # tool call index -> block index

    @property
    def has_tool_use(self) -> bool:
        return bool(self._tool_blocks)

    def feed(self, event: OutputEvent) -> list[Payload]:
        """The stream events for one output event (none for an empty delta)."""
        if isinstance(event, ContentDelta):
            return self._append("text", event.text, {"type": "text", "text": ""}, "text_delta")
        if isinstance(event, ReasoningDelta):
            return self._append("thinking", event.text, {"type": "thinking", "thinking": "", "signature": ""},
                                "thinking_delta")
        if isinstance(event, ToolCallStart):
            events = self._start({"type": "tool_use", "id": tool_use_id(event.id), "name": event.name, "input": {}})
            self._tool_blocks[event.index] = len(self.blocks) - 1
            return events
        if isinstance(event, ToolCallArguments):
            index = self._tool_blocks[event.index]
            return [_delta(index, {"type": "input_json_delta", "partial_json": event.text})] if event.text else []
        assert isinstance(event, ToolCallEnd)
        self.blocks[self._tool_blocks[event.index]]["input"] = tool_use_input(event.arguments)
        return self.close()

    def close(self) -> list[Payload]:
        """Close the open block, if any."""
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [{"type": "content_block_stop", "index": index}]

    def finish(self) -> list[Payload]:
        """Close the open block; a reply without any block gets one empty text block."""
        if self.blocks:
            return self.close()
        return self._start({"type": "text", "text": ""}) + self.close()

    def content(self) -> list[Payload]:
        """The blocks as a non-streaming reply lists them."""
        return [dict(block) for block in self.blocks]

    def _append(self, kind: str, text: str, empty: Payload, delta_type: str) -> list[Payload]:
        if not text:
            return []
        events = [] if self._is_open(kind) else self._start(empty)
        assert self._open is not None
        self.blocks[self._open][kind] += text
        return events + [_delta(self._open, {"type": delta_type, kind: text})]

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self.blocks[self._open]["type"] == kind

    def _start(self, block: Payload) -> list[Payload]:
        events = self.close()
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        return events + [{"type": "content_block_start", "index": self._open, "content_block": dict(block)}]


def tool_use_id(call_id: str) -> str:
    """The parser's `call_...` id in Anthropic's `toolu_...` form (the random part kept)."""
    return "toolu_" + call_id.removeprefix("call_")


def _delta(index: int, delta: Payload) -> Payload:
    return {"type": "content_block_delta", "index": index, "delta": delta}


async def message_events(message_start: Payload, body: AsyncIterator[Payload], keepalive_s: float,
                         as_error: Callable[[Exception], ApiError] | None = None) -> AsyncIterator[str]:
    """The whole SSE stream: message_start and a ping, then `body` (block events, message_delta,
    message_stop) with pings while it is silent; a failure mid-stream is an `error` event (`as_error`
    turns an exception into the ApiError it reports, issue 44)."""
    yield event_frame(message_start)
    yield PING_FRAME
    frames = _frames(body, as_error)
    async for frame in with_keepalive(frames, keepalive_s, keepalive_frame=PING_FRAME):
        yield frame


async def _frames(body: AsyncIterator[Payload], as_error: Callable[[Exception], ApiError] | None) -> AsyncIterator[str]:
    try:
        async for payload in body:
            yield event_frame(payload)
    except ApiError as exc:
        yield sse_frame(error_body(exc, "anthropic"), event="error")
    except Exception as exc:  # noqa: BLE001 - issue 44: a bug in this request's path ends it with an error event
        if as_error is None:
            raise
        yield sse_frame(error_body(as_error(exc), "anthropic"), event="error")

