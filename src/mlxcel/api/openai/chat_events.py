"""Chat-completion JSON for a parsed reply: reasoning, content and tool calls (Q, R, V).

Streaming: one `delta` per output event. Reasoning goes to `reasoning_content` and `reasoning`
(clients read one or the other); a tool call sends `id`, `type` and `function.name` once per
index, then `function.arguments` fragments whose concatenation is the arguments JSON.
Non-streaming: the same fields on `message`; `content` is null when the reply only made calls.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mlxcel.chat.output import ParsedReply
from mlxcel.chat.events import (
    ContentDelta, OutputEvent, ReasoningDelta, ToolCall, ToolCallArguments, ToolCallStart,
)  # fmt: skip


def event_delta(event: OutputEvent) -> dict[str, Any] | None:
    """The chunk `delta` for one event; None for events with nothing to send (a call's end)."""
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text, "reasoning": event.text}
    if isinstance(event, ToolCallStart):
        call = {"index": event.index, "id": event.id, "type": "function",
                "function": {"name": event.name, "arguments": ""}}
        return {"tool_calls": [call]}
    if isinstance(event, ToolCallArguments):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
    return None


def event_deltas(events: Iterable[OutputEvent]) -> list[dict[str, Any]]:
    """The deltas of a step's events, in order."""
    return [delta for delta in map(event_delta, events) if delta is not None]


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def message_json(reply: ParsedReply) -> dict[str, Any]:
    """The assistant `message` of a non-streaming choice."""
    content = reply.content if reply.content or not reply.has_tool_calls else None
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
        message["reasoning"] = reply.reasoning
    if reply.has_tool_calls:
        message["tool_calls"] = [tool_call_json(call) for call in reply.tool_calls]
    return message


def finish_reason(engine_reason: str, has_tool_calls: bool) -> str:
    """"tool_calls" for a reply that ended normally after making calls (V)."""
    return "tool_calls" if has_tool_calls and engine_reason == "stop" else engine_reason
