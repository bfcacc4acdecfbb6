"""The streaming state machine every tool-call format shares.

A parser reads the reply's content text in arbitrary pieces and emits `ContentDelta`s for text
outside calls and start/arguments/end events for calls (chat/events.py). Text that could still
turn out to be the start of call markup is held back, so no partial markup reaches content.
Formats differ only in how a call block starts (`_scan_start`), how its JSON is read
(`_new_reader`) and what may follow it (`_scan_after`).

Given the request's declared tool names, a call naming any other tool is no call (issue 26): it
emits nothing, and a block whose calls were all refused is content, markup included. With them,
every format also reads a Markdown code block (```json, or a bare ```) holding a call object
`{"name": ..., "arguments": {...}}` (or an array of them) anywhere in the reply as a call, as
small models often write one instead of their template's markup: only a declared name makes it
one, so a JSON example that names no declared tool stays text.
"""

from __future__ import annotations

import abc
import enum
import json
import logging
import secrets
import string
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from mlxcel.chat.events import ContentDelta, OutputEvent, ToolCall, ToolCallArguments, ToolCallEnd, ToolCallStart
from mlxcel.chat.tools.json_stream import JsonCallsReader

log = logging.getLogger(__name__)

_ALPHANUMERIC = string.ascii_letters + string.digits
_WHITESPACE = " \t\n\r"
FENCE = "```"
FENCE_LANGUAGES = ("json",)  # an info string a fenced call may carry (any case), besides none
FENCED_CALL_KEYS = ("name",)  # the first key of a fenced call object: {"name": ..., "arguments": ...}


def openai_call_id() -> str:
    """`call_` and 24 random letters/digits, as OpenAI writes tool-call ids."""
    return "call_" + "".join(secrets.choice(_ALPHANUMERIC) for _ in range(24))


class CallsReader(Protocol):
    """Reads one block of calls (JSON) and emits its events."""

    @property
    def is_done(self) -> bool: ...

    @property
    def is_error(self) -> bool: ...

    def feed(self, text: str, out: list[OutputEvent]) -> int: ...

    def close(self, out: list[OutputEvent]) -> None: ...


@dataclass(frozen=True, slots=True)
class CallStart:
    """Call markup found: content ends at `at`; the calls' JSON (or name) begins at `body`.

    `is_bare`: no marker, only JSON that looks like a call; if it names no function after
    all, its text is content.
    """

    at: int
    body: int
    is_bare: bool = False


class Mode(enum.Enum):
    CONTENT = enum.auto()
    OPENING = enum.auto()  # markup seen, the reader not yet chosen (Mistral's name form)
    CALLS = enum.auto()
    AFTER = enum.auto()  # a block of calls ended; its closing markup may follow


class ToolParser(abc.ABC):
    """Base streaming tool-call parser: `feed(text)` per content delta, then `finish()` once."""

    name: ClassVar[str] = ""
    start_markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, new_id: Callable[[], str] | None = None, declared: Collection[str] | None = None) -> None:
        self.new_id = new_id or self.default_id
        self.num_calls = 0
        self._declared = frozenset(declared) if declared is not None else None  # None: any name is a call
        self._mode = Mode.CONTENT
        self._buffer = ""
        self._held_space = ""  # trailing whitespace of content, dropped when a call follows it
        self._is_content_seen = False  # non-space content since the start or the last call
        self._reader: CallsReader | None = None
        self._block: list[str] = []  # the current block's text, markup included, until it proves a call
        self._is_bare = False
        # The current block (or, in content, the held text) is a Markdown code block, which ends at its closing fence.
        self._is_fenced = False
        self._num_calls_before = 0
        self._num_refused = 0  # calls of the current block naming an undeclared tool

    def accepts(self, name: str) -> bool:
        """Whether a call may name `name` (readers ask once per call, before it gets an index)."""
        if self._declared is None or name in self._declared:
            return True
        self._num_refused += 1
        log.info("a tool call names %r, which the request did not declare; it stays text", name[:100])
        return False

    @staticmethod
    def default_id() -> str:
        return openai_call_id()

    # --- the state machine ------------------------------------------------------------------

    def feed(self, text: str) -> list[OutputEvent]:
        """Add a piece of content text; return the events it completed."""
        out: list[OutputEvent] = []
        self._buffer += text
        while self._buffer and self._advance(out):
            pass
        return coalesce(out)

    def finish(self) -> list[OutputEvent]:
        """End of the reply: close a call in progress, release held text."""
        out: list[OutputEvent] = []
        if self._mode is Mode.CALLS and self._reader is not None:
            cut: list[OutputEvent] = []
            self._reader.close(cut)  # a bare block cut off before naming a function is dropped
            out.extend(mark_cut_calls(cut))
        if self._mode in (Mode.CALLS, Mode.AFTER) and self._is_refused_block():
            self._block.append(self._buffer)
            self._emit_content("".join(self._block), out)
        elif self._mode is Mode.CONTENT:
            held = self._buffer
            self._emit_content(final_fenced_content(held) if self._is_fenced else self._final_content(held), out)
            if self._held_space and not self.num_calls:
                out.append(ContentDelta(self._held_space))
        self._buffer, self._held_space, self._reader = "", "", None
        return coalesce(out)

    def _advance(self, out: list[OutputEvent]) -> bool:
        """One step on the buffer; False when it needs more text."""
        if self._mode is Mode.CONTENT:
            return self._advance_content(out)
        if self._mode is Mode.OPENING:
            return self._open_reader(out)
        if self._mode is Mode.CALLS:
            return self._advance_calls(out)
        return self._advance_after(out)

    def _advance_content(self, out: list[OutputEvent]) -> bool:
        found, self._is_fenced = self._find_start(self._buffer)
        if isinstance(found, CallStart):
            self._emit_content(self._buffer[: found.at], out)
            self._block, self._is_bare = [self._held_space + self._buffer[found.at : found.body]], found.is_bare
            self._held_space, self._num_calls_before, self._num_refused = "", self.num_calls, 0
            self._buffer = self._buffer[found.body :]
            self._mode = Mode.OPENING
            return True
        keep = len(self._buffer) - found
        self._emit_content(self._buffer[:keep], out)
        self._buffer = self._buffer[keep:]
        return False

    def _find_start(self, buffer: str) -> tuple[CallStart | int, bool]:
        """The format's own call start or a fenced call, whichever comes first (the format's at a
        tie), and whether it is the fenced one; as `_scan_start`, a count to hold if neither yet
        (then True: the held text is an undecided fence)."""
        own = self._scan_start(buffer)
        if not self._declared:
            return own, False  # a fenced block is a call only when it names a declared tool
        fenced = scan_fenced_call(buffer)
        own_at = own.at if isinstance(own, CallStart) else len(buffer) - own
        fenced_at = fenced.at if isinstance(fenced, CallStart) else len(buffer) - fenced
        return (fenced, True) if fenced_at < own_at else (own, False)

    def _open_reader(self, out: list[OutputEvent]) -> bool:
        opened = self._new_reader(self._buffer, out)
        if opened is None:
            return False
        self._reader, used = opened
        self._block.append(self._buffer[:used])
        self._buffer, self._mode = self._buffer[used:], Mode.CALLS
        return True

    def _advance_calls(self, out: list[OutputEvent]) -> bool:
        assert self._reader is not None
        used = self._reader.feed(self._buffer, out)
        self._block.append(self._buffer[:used])
        self._buffer = self._buffer[used:]
        if not (self._reader.is_done or self._reader.is_error):
            return False
        self._reader.close(out)
        self._mode, self._reader, self._is_content_seen = Mode.AFTER, None, False
        if self._is_bare and self.num_calls == self._num_calls_before:
            # A bare JSON block that named no (declared) function was the model's text, not a call.
            self._mode = Mode.CONTENT
            self._emit_content("".join(self._block), out)
        return True

    def _is_refused_block(self) -> bool:
        """The block named only undeclared tools: its text is content (a block naming none is dropped)."""
        return self._num_refused > 0 and self.num_calls == self._num_calls_before

    def _advance_after(self, out: list[OutputEvent]) -> bool:
        result = scan_closing_fence(self._buffer) if self._is_fenced else self._scan_after(self._buffer)
        if result is None:
            return False
        used, mode = result
        self._block.append(self._buffer[:used])
        self._buffer, self._mode = self._buffer[used:], mode
        if mode is Mode.CONTENT and self._is_refused_block():
            self._emit_content("".join(self._block), out)
        return True

    def _emit_content(self, text: str, out: list[OutputEvent]) -> None:
        if not text:
            return
        text = self._held_space + text
        if self.num_calls and not self._is_content_seen:
            text = text.lstrip(_WHITESPACE)  # the line break after a call block is markup
        kept = text.rstrip(_WHITESPACE)
        self._held_space = text[len(kept) :]
        if kept:
            out.append(ContentDelta(kept))
            self._is_content_seen = True

    def _next_index(self) -> int:
        self.num_calls += 1
        return self.num_calls - 1

    # --- what formats define -----------------------------------------------------------------

    @abc.abstractmethod
    def _scan_start(self, buffer: str) -> CallStart | int:
        """Where call markup starts in `buffer`, else how many characters at its end to hold."""

    def _new_reader(self, buffer: str, out: list[OutputEvent]) -> tuple[CallsReader, int] | None:
        """The reader for the block starting at `buffer` and how many characters the opening
        took (None: wait for more text)."""
        return JsonCallsReader(self._next_index, self.new_id, self.accepts), 0

    def _scan_after(self, buffer: str) -> tuple[int, Mode] | None:
        """After a block: how much markup to drop and the next mode (None: wait for more text)."""
        return 0, Mode.CONTENT

    def _final_content(self, held: str) -> str:
        """What of the text held at the end of the reply is content: a cut-off start marker is not."""
        return "" if any(m.startswith(held) for m in self.start_markers) else held


# --- helpers formats share ---------------------------------------------------------------------


def mark_cut_calls(closed: list[OutputEvent]) -> list[OutputEvent]:
    """The events of closing calls the reply's end cut off: a call whose arguments were not yet a
    whole object is not complete, and the closing fragment the reader made up to balance the JSON
    (or a whole "{}") is dropped, so nobody mistakes a partial call for a finished one (issue 46)."""
    ends = {e.index: e for e in closed if isinstance(e, ToolCallEnd)}
    made_up = {i: "".join(e.text for e in closed if isinstance(e, ToolCallArguments) and e.index == i)
               for i in ends}
    kept: list[OutputEvent] = []
    for event in closed:
        if isinstance(event, ToolCallArguments) and event.index in ends:
            continue
        if isinstance(event, ToolCallEnd) and (made_up[event.index] or not is_json_object(event.arguments)):
            written = event.arguments[: len(event.arguments) - len(made_up[event.index])]
            event = ToolCallEnd(event.index, event.id, event.name, written, is_complete=False)
        kept.append(event)
    return kept


def partial_suffix_len(buffer: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `buffer` that is a proper prefix of one of `markers`."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(buffer)), longest, -1):
            if buffer.endswith(marker[:size]):
                longest = size
                break
    return longest


def find_marker(buffer: str, markers: Sequence[str]) -> tuple[int, str] | None:
    """The earliest occurrence of any marker (the longer one at a tie)."""
    best: tuple[int, str] | None = None
    for marker in markers:
        at = buffer.find(marker)
        if at >= 0 and (best is None or (at, -len(marker)) < (best[0], -len(best[1]))):
            best = (at, marker)
    return best


def scan_fenced_call(buffer: str) -> CallStart | int:
    """Where a Markdown code block holding a call object starts in `buffer` (`at`: its fence; `body`:
    the JSON), else how many characters at its end to hold (a fence whose block is still undecided)."""
    at = buffer.find(FENCE)
    while at >= 0:
        verdict, body = _fenced_body(buffer[at + len(FENCE):])
        if verdict is Prefix.YES:
            return CallStart(at, at + len(FENCE) + body, is_bare=True)
        if verdict is Prefix.MAYBE:
            return len(buffer) - at
        at = buffer.find(FENCE, at + len(FENCE))
    return partial_suffix_len(buffer, (FENCE,))


def _fenced_body(rest: str) -> tuple[Prefix, int]:
    """After a fence: an optional `json` info string, then a call object's opening (where it starts)."""
    info = rest[: len(rest) - len(rest.lstrip(string.ascii_letters))]
    if info and info.lower() not in FENCE_LANGUAGES:
        is_cut = info == rest and any(lang.startswith(info.lower()) for lang in FENCE_LANGUAGES)
        return (Prefix.MAYBE if is_cut else Prefix.NO), 0
    verdict, json_at = json_call_prefix(rest[len(info):], FENCED_CALL_KEYS)
    return verdict, len(info) + json_at


def final_fenced_content(held: str) -> str:
    """Held text that opened a fence when the reply ended: content, unless it was opening a call."""
    rest = held[len(FENCE):]
    info = rest[: len(rest) - len(rest.lstrip(string.ascii_letters))]
    return "" if is_cut_json_call(rest[len(info):], FENCED_CALL_KEYS) else held


def scan_closing_fence(buffer: str) -> tuple[int, Mode] | None:
    """After a fenced call: drop the closing fence (if the model wrote one) and go back to content."""
    head = buffer.lstrip(_WHITESPACE)
    if len(head) < len(FENCE) and FENCE.startswith(head):
        return None  # maybe the closing fence
    skipped = len(buffer) - len(head)
    return (skipped + len(FENCE), Mode.CONTENT) if head.startswith(FENCE) else (0, Mode.CONTENT)


class Prefix(enum.Enum):
    """Whether text opens a bare JSON tool call."""

    YES = enum.auto()
    MAYBE = enum.auto()  # too short to tell
    NO = enum.auto()


def json_call_prefix(text: str, first_keys: Sequence[str], *, allow_array: bool = True) -> tuple[Prefix, int]:
    """Does `text` (after whitespace) open `{"<key>"` or `[{"<key>"` with key in `first_keys`?

    Returns the verdict and, for YES, where the JSON starts.
    """
    at = len(text) - len(text.lstrip(_WHITESPACE))
    i = at
    expected = ["{[" if allow_array else "{", '"']
    while expected:
        while i < len(text) and text[i] in _WHITESPACE:
            i += 1
        if i == len(text):
            return Prefix.MAYBE, at
        if text[i] not in expected[0]:
            return Prefix.NO, at
        if text[i] == "[":
            expected.insert(1, "{")
        i += 1
        expected.pop(0)
    return _key_verdict(text[i:], first_keys), at


def is_cut_json_call(text: str, first_keys: Sequence[str]) -> bool:
    """Whether a reply that ended with `text` was opening a JSON call: more than a lone
    `{` or `[`, and still a possible call opening."""
    body = text.strip(_WHITESPACE)
    return body not in ("", "{", "[") and json_call_prefix(body, first_keys)[0] is Prefix.MAYBE


def _key_verdict(rest: str, keys: Sequence[str]) -> Prefix:
    end = rest.find('"')
    if end < 0:
        return Prefix.MAYBE if any(k.startswith(rest) for k in keys) else Prefix.NO
    return Prefix.YES if rest[:end] in keys else Prefix.NO


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def coalesce(events: list[OutputEvent]) -> list[OutputEvent]:
    """Adjacent content deltas, and adjacent argument fragments of one call, joined (fewer chunks)."""
    merged: list[OutputEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
            merged[-1] = ContentDelta(last.text + event.text)
        elif isinstance(event, ToolCallArguments) and isinstance(last, ToolCallArguments) and last.index == event.index:
            merged[-1] = ToolCallArguments(event.index, last.text + event.text)
        else:
            merged.append(event)
    return merged


def collect_tool_calls(events: Sequence[OutputEvent]) -> list[ToolCall]:
    """The finished calls among `events` (for a non-streaming reply), in index order."""
    calls = [ToolCall(e.index, e.id, e.name, e.arguments, e.is_complete) for e in events if isinstance(e, ToolCallEnd)]
    return sorted(calls, key=lambda c: c.index)


__all__ = [
    "CallStart", "CallsReader", "ContentDelta", "Mode", "Prefix", "ToolCallArguments", "ToolCallEnd",
    "ToolCallStart", "ToolParser", "coalesce", "collect_tool_calls", "find_marker", "json_call_prefix", "openai_call_id",
    "partial_suffix_len",
]  # fmt: skip
