"""One generated chat reply's text, split into reasoning, content and tool calls as it streams.

An adapter makes one `ChatOutputParser` per choice, feeds it every text delta the
TextAssembler returns, calls `finish()` at the end, and reads `result()` for a non-streaming
reply (chat/events.py lists what it emits). Stop strings given to the parser apply to the
answer only: reasoning (and a budget's forced `</think>`) never ends the reply (R).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlxcel.chat.events import (
    ContentDelta, OutputEvent, ReasoningDelta, ToolCall, ToolCallArguments, ToolCallEnd, ToolCallStart,
)  # fmt: skip
from mlxcel.chat.harmony import reply_splitter
from mlxcel.chat.reasoning import ReasoningFormat, ThinkTokens
from mlxcel.text.stop import StopMatcher
from mlxcel.chat.tools.base import ToolParser


@dataclass(frozen=True, slots=True)
class ParsedReply:
    """The whole reply, as a non-streaming response reports it."""

    content: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]

    @property
    def has_tool_calls(self) -> bool:
        return bool(self.tool_calls)

    @property
    def complete_calls(self) -> tuple[ToolCall, ...]:
        """The calls the model finished (a call cut by the token limit is not one of them)."""
        return tuple(call for call in self.tool_calls if call.is_complete)

    def finish_reason(self, engine_reason: str) -> str:
        """The chat finish_reason: "tool_calls" when a reply that ended normally made calls."""
        return "tool_calls" if self.complete_calls and engine_reason == "stop" else engine_reason


class ChatOutputParser:
    """Reasoning splitter, then (when the request has tools) a tool-call parser on the content."""

    def __init__(
        self,
        *,
        think: ThinkTokens | None,
        reasoning_format: ReasoningFormat = ReasoningFormat.AUTO,
        starts_in_reasoning: bool = False,
        tool_parser: ToolParser | None = None,
        stops: Sequence[str] = (),
        max_tool_calls: int | None = None,
    ) -> None:
        markers = (think.start, think.end) if think is not None else None
        self._splitter = reply_splitter(  # harmony markers read gpt-oss's channels
            markers, reasoning_format=reasoning_format, starts_in_reasoning=starts_in_reasoning
        )
        self._tools = tool_parser
        self._stops = StopMatcher(stops)
        self._max_calls = max_tool_calls  # parallel_tool_calls false: calls after the first are dropped
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._is_finished = False

    @property
    def stop(self) -> str | None:
        """The stop string that ended the answer, if one did (the caller then ends generation)."""
        return self._stops.matched

    def feed(self, text: str) -> list[OutputEvent]:
        """One text delta in; the reasoning, content and tool-call events it completed out."""
        return self._route(self._splitter.feed(text), is_final=False)

    def finish(self) -> list[OutputEvent]:
        """End of the reply: everything still held."""
        if self._is_finished:
            return []
        self._is_finished = True
        return self._route(self._splitter.finish(), is_final=True)

    def result(self) -> ParsedReply:
        """The reply so far (complete after `finish()`)."""
        return ParsedReply("".join(self._content), self._splitter.reasoning_text, tuple(self._calls))

    def _route(self, split: list[ContentDelta | ReasoningDelta], *, is_final: bool) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        for event in split:
            if isinstance(event, ContentDelta):
                self._answer(self._stops.push(event.text)[0], out)
            else:
                out.append(event)
        if is_final:
            self._answer(self._stops.flush(), out)
            if self._tools is not None:
                out.extend(self._tools.finish())
        out = [e for e in out if self._is_allowed(e)]
        for event in out:
            self._record(event)
        return out

    def _is_allowed(self, event: OutputEvent) -> bool:
        is_call = isinstance(event, ToolCallStart | ToolCallArguments | ToolCallEnd)
        return not is_call or self._max_calls is None or event.index < self._max_calls

    def _answer(self, text: str, out: list[OutputEvent]) -> None:
        """Answer text that passed the stop strings: to the tool parser, or out as content."""
        if not text:
            return
        out.extend(self._tools.feed(text) if self._tools is not None else [ContentDelta(text)])

    def _record(self, event: OutputEvent) -> None:
        if isinstance(event, ContentDelta):
            self._content.append(event.text)
        elif isinstance(event, ToolCallEnd):
            self._calls.append(ToolCall(event.index, event.id, event.name, event.arguments, event.is_complete))
