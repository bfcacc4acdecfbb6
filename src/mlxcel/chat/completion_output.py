"""A raw completion's text with stop strings that spare its reasoning block (spec R).

Raw completions (`/v1/completions`, llama-server `/completion`) return the generated text as is,
reasoning markers included. When the request budgets reasoning, the `</think>` the budget forces
must not trigger the caller's stop strings ("the forced `</think>` streams as an ordinary delta
and does not trigger user stop sequences"), so stop strings are matched only on the text after
the reasoning block. Without a reasoning block the whole text is matched, as usual.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from mlxcel.chat.output import ParsedReply
from mlxcel.chat.events import ContentDelta, OutputEvent
from mlxcel.chat.reasoning import ThinkTokens
from mlxcel.text.stop import StopMatcher

_SPACE = " \t\n\r"


class _Phase(enum.Enum):
    START = enum.auto()  # only whitespace so far: a start marker may open a reasoning block
    REASONING = enum.auto()
    ANSWER = enum.auto()


class CompletionOutputParser:
    """Feeds a raw completion's text deltas through; events are `ContentDelta`s of the raw text."""

    def __init__(self, think: ThinkTokens | None, *, starts_in_reasoning: bool, stops: Sequence[str] = ()) -> None:
        self._think = think
        self._phase = _Phase.ANSWER if think is None else _Phase.START
        if think is not None and starts_in_reasoning:
            self._phase = _Phase.REASONING
        self._stops = StopMatcher(stops)
        self._pending = ""  # START: text not yet known to open a block
        self._tail = ""  # REASONING: the end of the block so far, to find a marker split over deltas
        self._text: list[str] = []

    @property
    def stop(self) -> str | None:
        return self._stops.matched

    def feed(self, text: str) -> list[OutputEvent]:
        """One text delta in; the raw text that is final now out."""
        if self._phase is _Phase.START:
            return self._feed_start(text, is_final=False)
        if self._phase is _Phase.REASONING:
            return self._feed_reasoning(text)
        return self._emit(self._stops.push(text)[0])

    def finish(self) -> list[OutputEvent]:
        """The end of generation: what was held back."""
        events = self._feed_start("", is_final=True) if self._phase is _Phase.START else []
        return events + self._emit(self._stops.flush())

    def result(self) -> ParsedReply:
        return ParsedReply("".join(self._text), "", ())

    def _feed_start(self, text: str, *, is_final: bool) -> list[OutputEvent]:
        assert self._think is not None
        self._pending += text
        head = self._pending.lstrip(_SPACE)
        if head.startswith(self._think.start):
            self._phase, pending, self._pending = _Phase.REASONING, self._pending, ""
            return self._feed_reasoning(pending)
        if not is_final and self._think.start.startswith(head):
            return []  # still undecided
        self._phase, pending, self._pending = _Phase.ANSWER, self._pending, ""
        return self._emit(self._stops.push(pending)[0])

    def _feed_reasoning(self, text: str) -> list[OutputEvent]:
        assert self._think is not None
        end = self._think.end
        seen = self._tail + text
        at = seen.find(end)
        if at < 0:
            self._tail = seen[-(len(end) - 1):] if len(end) > 1 else ""
            return self._emit(text)
        cut = at + len(end) - len(self._tail)  # where the block ends within `text`
        self._phase, self._tail = _Phase.ANSWER, ""
        return self._emit(text[:cut]) + self._emit(self._stops.push(text[cut:])[0])

    def _emit(self, text: str) -> list[OutputEvent]:
        if not text:
            return []
        self._text.append(text)
        return [ContentDelta(text)]
