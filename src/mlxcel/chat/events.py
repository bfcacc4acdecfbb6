"""What the chat-output parsers emit while a reply streams: protocol-neutral deltas.

A `ReasoningSplitter` (chat/reasoning.py) yields `ReasoningDelta` and `ContentDelta`; a tool
parser (chat/tools/) turns content into `ContentDelta`s and tool-call events. Adapters map these
to their wire format: chat `delta.reasoning_content` / `delta.content` / `delta.tool_calls`,
Responses output items, Anthropic content blocks.

For one tool call the order is always: `ToolCallStart` (index, id, name: once), zero or more
`ToolCallArguments` fragments, `ToolCallEnd`. The fragments of one call, concatenated, equal
`ToolCallEnd.arguments` and parse as JSON (`json.loads`), unless the reply was cut inside the call
(`is_complete` False, issue 46): then they are the text the model wrote, never closed or made up.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ContentDelta:
    """Answer text (not reasoning, not tool-call markup)."""

    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """Reasoning ("thinking") text, without its `<think>` / `</think>` markers."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    """A tool call begins: its position among this reply's calls, its id and the function name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArguments:
    """The next fragment of a call's arguments JSON text."""

    index: int
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    """A tool call ended; `arguments` is the whole arguments JSON (all fragments joined). A call the
    reply's end cut off is not complete: its arguments are what was written, possibly not JSON."""

    index: int
    id: str
    name: str
    arguments: str
    is_complete: bool = True


ToolEvent = ToolCallStart | ToolCallArguments | ToolCallEnd
OutputEvent = ContentDelta | ReasoningDelta | ToolCallStart | ToolCallArguments | ToolCallEnd


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A finished call, as a non-streaming reply lists it."""

    index: int
    id: str
    name: str
    arguments: str  # JSON text of an object (when complete)
    is_complete: bool = True  # False: cut off by the reply's end (the token limit), arguments partial
