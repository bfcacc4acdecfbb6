"""gpt-oss's harmony reply format: messages on channels, split into reasoning, content and calls.

A harmony reply is a run of messages (openai/harmony docs/format.md); the generation prompt
ends in `<|start|>assistant`, so the first message's header starts at its channel:

    <|channel|>analysis<|message|>chain of thought<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>The answer.<|return|>

`analysis` bodies are reasoning; `final` bodies, and `commentary` bodies without a recipient (a
preamble meant for the user), are content. A message with a recipient (`to=...`, in the role
or the channel part of the header) is a tool call: its body goes on as content in one canonical
spelling, `<|channel|>commentary to=RECIPIENT <|constrain|>json<|message|>BODY<|call|>`, which
chat/tools/harmony.py reads (and leaves as text where the request declared no such tool).

`HarmonySplitter` takes the place of `ReasoningSplitter` (same interface) when the model's
reasoning markers are harmony's (`HARMONY_MARKERS`, found in the vocabulary by
`reasoning.infer_think_tokens`); `reply_splitter` picks one. A reply that does not open with
harmony markup is content as it stands.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlxcel.chat.events import ContentDelta, ReasoningDelta
from mlxcel.chat.reasoning import ReasoningFormat, ReasoningSplitter
from mlxcel.chat.tools.base import find_marker, partial_suffix_len

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
RETURN = "<|return|>"
CALL = "<|call|>"
# The reasoning "block" as the budget and the grammar gate see it (reasoning.THINK_MARKER_CANDIDATES).
HARMONY_MARKERS = (CHANNEL + "analysis" + MESSAGE, END)
# Where a message body ends: its end markers, or the next message's start (a model that skipped `<|end|>`).
BODY_ENDS = (END, RETURN, CALL, START)
CALL_OPENER = CHANNEL + "commentary to="  # the canonical call header, up to the recipient
_MAX_HEADER_CHARS = 512  # longer "headers" are no harmony header: the reply is plain text
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_SPACE = " \t\n\r"

SplitEvent = ReasoningDelta | ContentDelta


@dataclass(frozen=True, slots=True)
class Header:
    """One message's header: its channel and, for a tool call, the recipient."""

    channel: str
    recipient: str | None

    @classmethod
    def parse(cls, text: str) -> Header:
        role_part, _, channel_part = text.partition(CHANNEL)
        channel = re.split(r"[\s<]", channel_part.strip(_SPACE), maxsplit=1)[0] if channel_part else ""
        found = _RECIPIENT.search(role_part) or _RECIPIENT.search(channel_part)
        return cls(channel, found.group(1) if found else None)


class HarmonySplitter(ReasoningSplitter):
    """Splits a streamed harmony reply into reasoning and content deltas (tool-call messages
    stay content, in the canonical spelling above, for the tool parser). `feed`, `reasoning_text`
    and deepseek-legacy's raw content are ReasoningSplitter's; the steps read messages."""

    def __init__(self, *, reasoning_format: ReasoningFormat = ReasoningFormat.AUTO) -> None:
        super().__init__(HARMONY_MARKERS, reasoning_format=reasoning_format)
        self._header: Header | None = None  # None: reading a header
        self._is_plain = False  # the reply is not harmony: all of it is content

    def finish(self) -> list[SplitEvent]:
        out: list[SplitEvent] = []
        while self._buffer and self._step(out, is_final=True):
            pass
        if self._header is not None and self._header.recipient is not None:
            out.append(ContentDelta(CALL))  # a call cut off (or ended by the hidden `<|call|>` stop token)
        self._buffer = ""
        return self._legacy("", out)

    def _step(self, out: list[SplitEvent], *, is_final: bool) -> bool:
        if self._is_plain:
            out.append(ContentDelta(self._buffer))
            self._buffer = ""
            return False
        if self._header is None:
            return self._read_header(out, is_final)
        return self._read_body(out, is_final)

    def _read_header(self, out: list[SplitEvent], is_final: bool) -> bool:
        head = self._buffer.lstrip(_SPACE)
        at = head.find(MESSAGE)
        if not _may_be_header(head[:at] if at >= 0 else head):
            self._is_plain = True  # not harmony (or no longer): the rest is content as it stands
            return True
        if at < 0:
            if is_final:
                self._buffer = ""  # a header cut off by the end of the reply
            return False
        self._header = Header.parse(head[:at])
        self._buffer = head[at + len(MESSAGE) :]
        if self._header.recipient is not None:
            out.append(ContentDelta(f"{CALL_OPENER}{self._header.recipient} {CONSTRAIN}json{MESSAGE}"))
        return True

    def _read_body(self, out: list[SplitEvent], is_final: bool) -> bool:
        assert self._header is not None
        found = find_marker(self._buffer, BODY_ENDS)
        if found is not None:
            at, marker = found
            self._emit(self._buffer[:at], out)
            if self._header.recipient is not None:
                out.append(ContentDelta(CALL))
            self._header = None
            self._buffer = self._buffer[at + (0 if marker == START else len(marker)) :]
            return True
        keep = len(self._buffer) - partial_suffix_len(self._buffer, BODY_ENDS)
        if is_final and not self._buffer[keep:].startswith("<|"):
            keep = len(self._buffer)  # a lone `<` at the end is text; `<|en` is a cut-off marker
        self._emit(self._buffer[:keep], out)
        self._buffer = self._buffer[keep:]
        return False

    def _emit(self, text: str, out: list[SplitEvent]) -> None:
        assert self._header is not None
        if not text:
            return
        if self._header.channel == "analysis" and self._header.recipient is None:
            if not self.reasoning:
                text = text.lstrip(_SPACE)
            if text:
                self.reasoning.append(text)
                out.append(ReasoningDelta(text))
            return
        out.append(ContentDelta(text))


def _may_be_header(text: str) -> bool:
    """Whether `text` is, or may still become, a message header: it opens with `<|start|>` or
    `<|channel|>` and is short."""
    return len(text) <= _MAX_HEADER_CHARS and any(text.startswith(m) or m.startswith(text) for m in (START, CHANNEL))


def reply_splitter(
    markers: tuple[str, str] | None, *, reasoning_format: ReasoningFormat, starts_in_reasoning: bool
) -> ReasoningSplitter | HarmonySplitter:
    """The splitter for a model's reasoning markers: harmony's reads the whole message structure."""
    if markers == HARMONY_MARKERS and reasoning_format.is_parsed:
        return HarmonySplitter(reasoning_format=reasoning_format)
    return ReasoningSplitter(markers, reasoning_format=reasoning_format, starts_in_reasoning=starts_in_reasoning)
