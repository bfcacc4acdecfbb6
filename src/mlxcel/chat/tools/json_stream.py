"""Incremental JSON reading for streamed tool calls.

`JsonScanner` follows JSON syntax one character at a time and reports where keys and values
begin and end. `ArgumentsStream` turns the raw text of a call's `arguments` value into
fragments whose concatenation always parses: separators and keys are held back until the next
value starts, raw control characters inside strings are escaped, and `end()` closes whatever a
truncated reply left open. Three `ValueReader`s (one JSON value through its own scanner, up to
its end or a syntax error) emit the call events: `CallObjectStream` reads one call object
(`{"name": .., "arguments": ..}`, also the OpenAI-shaped `{"type": "function", "function": {..}}`),
`JsonCallsReader` a call object, an array of them, or a `{"tool_calls": [..]}` /
`{"tool_call": {..}}` wrapper, and `NamedArgumentsCall` the arguments of a call named outside the JSON.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from mlxcel.chat.events import OutputEvent, ToolCallArguments, ToolCallEnd, ToolCallStart

log = logging.getLogger(__name__)

_WHITESPACE = " \t\n\r"
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_CLOSERS = {"{": "}", "[": "]"}
NAME_KEYS = ("name",)
ARGUMENT_KEYS = ("arguments", "parameters")


class State(enum.Enum):
    VALUE = enum.auto()  # a value must come (start, after ':' or after ',' in an array)
    ARRAY_FIRST = enum.auto()  # after '[': a value or ']'
    OBJECT_FIRST = enum.auto()  # after '{': a key or '}'
    KEY = enum.auto()  # after ',' in an object: a key
    COLON = enum.auto()
    AFTER_VALUE = enum.auto()  # ',' or a closer
    STRING = enum.auto()
    ESCAPE = enum.auto()
    UNICODE = enum.auto()
    NUMBER = enum.auto()
    LITERAL = enum.auto()
    DONE = enum.auto()
    ERROR = enum.auto()


class Number(enum.Enum):
    """Where inside a number we are; the ones marked open need a digit to be valid."""

    SIGN = enum.auto()  # open
    ZERO = enum.auto()
    INT = enum.auto()
    DOT = enum.auto()  # open
    FRACTION = enum.auto()
    EXP = enum.auto()  # open
    EXP_SIGN = enum.auto()  # open
    EXPONENT = enum.auto()


_OPEN_NUMBER = frozenset({Number.SIGN, Number.DOT, Number.EXP, Number.EXP_SIGN})


class Event(enum.Enum):
    KEY = enum.auto()  # a key string closed (text in scanner.key)
    VALUE_START = enum.auto()
    VALUE_END = enum.auto()


@dataclass(frozen=True, slots=True)
class ScanEvent:
    kind: Event
    depth: int  # 0 = the top value; 1 = a member of the top container


class JsonScanner:
    """A character-at-a-time JSON syntax follower (no values are built, only positions)."""

    def __init__(self) -> None:
        self.state = State.VALUE
        self.failed = False  # a character broke the syntax; `state` keeps the last good state
        self.stack: list[str] = []
        self.key = ""  # the last key read
        self._is_key = False
        self._key_raw: list[str] = []
        self._literal_rest = ""
        self._hex_left = 0
        self._number = Number.INT

    @property
    def is_done(self) -> bool:
        return self.state is State.DONE

    @property
    def is_error(self) -> bool:
        return self.failed

    @property
    def is_in_value_text(self) -> bool:
        """Inside a string value, a number or a literal (not a key, not between tokens)."""
        if self.state in (State.STRING, State.ESCAPE, State.UNICODE):
            return not self._is_key
        return self.state in (State.NUMBER, State.LITERAL)

    @property
    def is_in_string_value(self) -> bool:
        return self.state is State.STRING and not self._is_key

    def step(self, ch: str) -> list[ScanEvent]:
        """Consume one character; the events it caused, in order. After a syntax error the
        scanner stays failed, ignores input, and keeps the state before the bad character."""
        if self.failed:
            return []
        before = self.state
        events = self._step(ch)
        if self.state is State.ERROR:
            self.state, self.failed = before, True
            return []
        return events

    def _step(self, ch: str) -> list[ScanEvent]:
        events: list[ScanEvent] = []
        if self.state is State.NUMBER and self._continue_number(ch):
            return events
        if self.state is State.NUMBER:
            self._end_value(events)
        if self.state in (State.STRING, State.ESCAPE, State.UNICODE):
            self._string_char(ch, events)
        elif self.state is State.LITERAL:
            self._literal_char(ch, events)
        elif ch in _WHITESPACE:
            pass
        else:
            self._structural(ch, events)
        return events

    def completion(self) -> str:
        """Text that closes the value being read and every open container (for a cut-off reply)."""
        return self.value_completion() + "".join(_CLOSERS[c] for c in reversed(self.stack))

    def value_completion(self) -> str:
        if self.state is State.STRING and not self._is_key:
            return '"'
        if self.state is State.ESCAPE and not self._is_key:
            return '\\"'  # the pending backslash becomes an escaped backslash, then the quote
        if self.state is State.UNICODE and not self._is_key:
            return "0" * self._hex_left + '"'
        if self.state is State.NUMBER:
            return "0" if self._number in _OPEN_NUMBER else ""
        if self.state is State.LITERAL:
            return self._literal_rest
        return ""

    # --- steps -------------------------------------------------------------------------------

    def _structural(self, ch: str, events: list[ScanEvent]) -> None:
        state = self.state
        if state in (State.VALUE, State.ARRAY_FIRST):
            if ch == "]" and state is State.ARRAY_FIRST:
                self._close(ch, events)
            else:
                self._start_value(ch, events)
        elif state in (State.OBJECT_FIRST, State.KEY):
            if ch == "}" and state is State.OBJECT_FIRST:
                self._close(ch, events)
            elif ch == '"':
                self.state, self._is_key, self._key_raw = State.STRING, True, ['"']
            else:
                self.state = State.ERROR
        elif state is State.COLON:
            self.state = State.VALUE if ch == ":" else State.ERROR
        elif state is State.AFTER_VALUE:
            self._after_value(ch, events)
        else:  # DONE: nothing more may follow
            self.state = State.ERROR

    def _start_value(self, ch: str, events: list[ScanEvent]) -> None:
        depth = len(self.stack)
        if ch in "{[":
            self.stack.append(ch)
            self.state = State.OBJECT_FIRST if ch == "{" else State.ARRAY_FIRST
        elif ch == '"':
            self.state, self._is_key = State.STRING, False
        elif ch == "-" or ch.isdigit():
            self.state = State.NUMBER
            self._number = Number.SIGN if ch == "-" else Number.ZERO if ch == "0" else Number.INT
        elif ch in _LITERALS:
            self.state, self._literal_rest = State.LITERAL, _LITERALS[ch]
        else:
            self.state = State.ERROR
            return
        events.append(ScanEvent(Event.VALUE_START, depth))

    def _after_value(self, ch: str, events: list[ScanEvent]) -> None:
        if not self.stack:
            self.state = State.ERROR
        elif ch == ",":
            self.state = State.KEY if self.stack[-1] == "{" else State.VALUE
        elif ch == _CLOSERS[self.stack[-1]]:
            self._close(ch, events)
        else:
            self.state = State.ERROR

    def _close(self, ch: str, events: list[ScanEvent]) -> None:
        self.stack.pop()
        self._end_value(events)

    def _end_value(self, events: list[ScanEvent]) -> None:
        events.append(ScanEvent(Event.VALUE_END, len(self.stack)))
        self.state = State.AFTER_VALUE if self.stack else State.DONE

    def _string_char(self, ch: str, events: list[ScanEvent]) -> None:
        if self._is_key:
            self._key_raw.append(ch)
        if self.state is State.ESCAPE:
            if ch == "u":
                self.state, self._hex_left = State.UNICODE, 4
            elif ch in '"\\/bfnrt':
                self.state = State.STRING
            else:
                self.state = State.ERROR
        elif self.state is State.UNICODE:
            if ch not in "0123456789abcdefABCDEF":
                self.state = State.ERROR
                return
            self._hex_left -= 1
            if not self._hex_left:
                self.state = State.STRING
        elif ch == "\\":
            self.state = State.ESCAPE
        elif ch == '"':
            self._close_string(events)

    def _close_string(self, events: list[ScanEvent]) -> None:
        if self._is_key:
            self.key = _decode_string("".join(self._key_raw))
            self._is_key = False
            self.state = State.COLON
            events.append(ScanEvent(Event.KEY, len(self.stack)))
        else:
            self._end_value(events)

    def _literal_char(self, ch: str, events: list[ScanEvent]) -> None:
        if not self._literal_rest or ch != self._literal_rest[0]:
            self.state = State.ERROR
            return
        self._literal_rest = self._literal_rest[1:]
        if not self._literal_rest:
            self._end_value(events)

    def _continue_number(self, ch: str) -> bool:
        """Advance the number state with `ch`; False when `ch` is not part of the number."""
        nxt = _NUMBER_STEPS.get((self._number, _number_class(ch)))
        if nxt is None:
            if self._number in _OPEN_NUMBER:
                self.state = State.ERROR
                return True  # consumed into the error
            return False
        self._number = nxt
        return True


def _number_class(ch: str) -> str:
    if ch == "0":
        return "0"
    if ch.isdigit() and ch.isascii():
        return "1"
    return ch.lower() if ch in "eE" else ch


_NUMBER_STEPS = {
    (Number.SIGN, "0"): Number.ZERO, (Number.SIGN, "1"): Number.INT,
    (Number.ZERO, "."): Number.DOT, (Number.ZERO, "e"): Number.EXP,
    (Number.INT, "0"): Number.INT, (Number.INT, "1"): Number.INT, (Number.INT, "."): Number.DOT,
    (Number.INT, "e"): Number.EXP,
    (Number.DOT, "0"): Number.FRACTION, (Number.DOT, "1"): Number.FRACTION,
    (Number.FRACTION, "0"): Number.FRACTION, (Number.FRACTION, "1"): Number.FRACTION,
    (Number.FRACTION, "e"): Number.EXP,
    (Number.EXP, "+"): Number.EXP_SIGN, (Number.EXP, "-"): Number.EXP_SIGN,
    (Number.EXP, "0"): Number.EXPONENT, (Number.EXP, "1"): Number.EXPONENT,
    (Number.EXP_SIGN, "0"): Number.EXPONENT, (Number.EXP_SIGN, "1"): Number.EXPONENT,
    (Number.EXPONENT, "0"): Number.EXPONENT, (Number.EXPONENT, "1"): Number.EXPONENT,
}  # fmt: skip


def _decode_string(raw: str) -> str:
    """The text of a complete JSON string literal ("" if it is not one)."""
    try:
        value = json.loads(raw, strict=False)
    except ValueError:
        return ""
    return value if isinstance(value, str) else ""


def _escape_control(ch: str) -> str:
    """A raw control character inside a JSON string, written as an escape (strict JSON needs it)."""
    return json.dumps(ch)[1:-1] if ord(ch) < 0x20 else ch


class JsonTextStream:
    """JSON text in, fragments out; the fragments so far plus `end()` always parse.

    Separators, whitespace and keys are held until the value after them begins, so a reply cut
    at any point leaves only an unfinished value and open containers, which `end()` closes.
    Text from the first syntax error on is dropped.
    """

    def __init__(self) -> None:
        self.scanner = JsonScanner()
        self._held: list[str] = []
        self.num_emitted_chars = 0

    def feed(self, text: str) -> str:
        out: list[str] = []
        for ch in text:
            if self.scanner.is_done or self.scanner.is_error:
                break
            was_in_string = self.scanner.is_in_string_value
            events = self.scanner.step(ch)
            if self.scanner.is_error:
                break
            self._held.append(_escape_control(ch) if was_in_string else ch)
            if self._is_flush_point(ch, events):
                out.extend(self._held)
                self._held.clear()
        emitted = "".join(out)
        self.num_emitted_chars += len(emitted)
        return emitted

    def _is_flush_point(self, ch: str, events: list[ScanEvent]) -> bool:
        """Whether `ch` belongs to a value (then it and everything held before it are safe)."""
        if self.scanner.is_in_value_text:
            return True
        for event in events:
            if event.kind is Event.VALUE_START:
                return True
            # A number ends on the next character, which may be a separator: not part of a value.
            if event.kind is Event.VALUE_END and ch not in ",:" and ch not in _WHITESPACE:
                return True
        return False

    def end(self) -> str:
        """What closes the emitted text ("" when it is already a whole value or nothing was emitted)."""
        if self.scanner.is_done or not self.num_emitted_chars:
            return ""
        return self.scanner.completion()


class ArgumentsStream:
    """The `arguments` value of one call, raw JSON text in, argument-JSON fragments out.

    An object value streams as written. A string value (some models write the arguments as a
    JSON string holding JSON) streams its decoded content. Any other value is read whole and
    becomes "{}" unless it is an object.
    """

    def __init__(self) -> None:
        self._mode: str | None = None  # "object", "string" or "other"
        self._json = JsonTextStream()
        self._raw: list[str] = []  # "other" mode: the whole value
        self._string = _StringDecoder()
        self._emitted: list[str] = []

    def feed(self, text: str) -> str:
        if not text:
            return ""
        if self._mode is None:
            self._mode = "object" if text[0] == "{" else "string" if text[0] == '"' else "other"
        if self._mode == "object":
            fragment = self._json.feed(text)
        elif self._mode == "string":
            fragment = self._json.feed(self._string.feed(text))
        else:
            self._raw.append(text)
            fragment = ""
        self._emitted.append(fragment)
        return fragment

    def end(self) -> str:
        """The closing fragment once the value ended (or the reply was cut off)."""
        if self._mode == "other":
            fragment = _other_value_arguments("".join(self._raw))
        elif self._json.num_emitted_chars == 0:
            fragment = "{}"
        else:
            fragment = self._json.end()
        self._emitted.append(fragment)
        return fragment

    @property
    def text(self) -> str:
        return "".join(self._emitted)


def _other_value_arguments(raw: str) -> str:
    try:
        value = json.loads(raw)
    except ValueError:
        return "{}"
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else "{}"


class _StringDecoder:
    """Decodes the body of a JSON string as it streams (the opening quote included in input)."""

    def __init__(self) -> None:
        self._started = False
        self._pending = ""  # an escape sequence not yet complete
        self.is_closed = False

    def feed(self, text: str) -> str:
        out: list[str] = []
        for ch in text:
            if self.is_closed:
                break
            if not self._started:
                self._started = True
                continue
            if self._pending:
                self._pending += ch
                out.append(self._decode_pending())
            elif ch == "\\":
                self._pending = ch
            elif ch == '"':
                self.is_closed = True
            else:
                out.append(ch)
        return "".join(out)

    def _decode_pending(self) -> str:
        pending = self._pending
        if pending[1] == "u" and len(pending) < 6:
            return ""
        self._pending = ""
        try:
            return json.loads(f'"{pending}"')
        except ValueError:
            return ""


IdFactory = Callable[[], str]
NamePolicy = Callable[[str], bool]  # whether a call may name this tool (ToolParser.accepts)


def any_name(name: str) -> bool:
    return True


class ValueReader:
    """Reads one JSON value through its own scanner, a character at a time, up to the value's end
    or a syntax error; `_step` does what each reader does with a character (the `CallsReader` shape)."""

    def __init__(self) -> None:
        self.scanner = JsonScanner()

    @property
    def is_done(self) -> bool:
        return self.scanner.is_done

    @property
    def is_error(self) -> bool:
        return self.scanner.is_error

    def feed(self, text: str, out: list[OutputEvent]) -> int:
        """Read `text`; returns how many characters belonged to the JSON value (up to an error)."""
        for i, ch in enumerate(text):
            if self.scanner.is_done or self.scanner.is_error or not self._step(ch, out):
                return i
        return len(text)

    def _step(self, ch: str, out: list[OutputEvent]) -> bool:
        """Read one character; False when it broke the syntax and is not this value's."""
        raise NotImplementedError


class CallObjectStream(ValueReader):
    """One call object, from its `{` to its `}`; emits start/arguments/end events.

    The name is emitted once, as soon as it is known; argument text read before the name is
    held and emitted right after the start. A call that never names a function, or names one
    `accepts` refuses, emits nothing.
    """

    def __init__(self, next_index: Callable[[], int], new_id: IdFactory, accepts: NamePolicy = any_name) -> None:
        super().__init__()
        self._next_index = next_index
        self._new_id = new_id
        self._accepts = accepts
        self._members = {1}  # depths whose keys are call members (2 inside "function": {...})
        self._capture: str | None = None  # the member whose value is being read
        self._capture_depth = -1
        self._name_raw: list[str] = []
        self._args: ArgumentsStream | None = None
        self._held_args: list[str] = []
        self.index: int | None = None
        self.id = ""
        self.name: str | None = None

    def _step(self, ch: str, out: list[OutputEvent]) -> bool:
        events = self.scanner.step(ch)
        if self.scanner.is_error:
            return True  # counted as read: the next character finds the reader failed
        for event in events:
            self._on_event(event, ch)
        if self._capture == "name":
            self._name_raw.append(ch)
        elif self._capture == "arguments":
            self._emit_arguments(self._arguments().feed(ch), out)
        for event in events:
            if event.kind is Event.VALUE_END and event.depth == self._capture_depth:
                self._finish_member(out)
        return True

    def _on_event(self, event: ScanEvent, ch: str) -> None:
        if self._capture is None and event.kind is Event.VALUE_START and event.depth in self._members:
            key = self.scanner.key
            if key == "function" and ch == "{":
                self._members.add(event.depth + 1)
            elif (key in NAME_KEYS or key == "function") and ch == '"':  # a name is a string
                self._start_capture("name", event.depth)
            elif key in ARGUMENT_KEYS and self._args is None:
                self._start_capture("arguments", event.depth)

    def _start_capture(self, what: str, depth: int) -> None:
        self._capture, self._capture_depth = what, depth

    def _finish_member(self, out: list[OutputEvent]) -> None:
        if self._capture == "name" and self.name is None:
            name = _decode_string("".join(self._name_raw))
            if name and self._accepts(name):
                self._start(name, out)
            elif name:
                self.name = name  # refused: no index, so nothing of this call is emitted
        self._capture, self._capture_depth = None, -1

    def _arguments(self) -> ArgumentsStream:
        if self._args is None:
            self._args = ArgumentsStream()
        return self._args

    def _start(self, name: str, out: list[OutputEvent]) -> None:
        self.name, self.index, self.id = name, self._next_index(), self._new_id()
        out.append(ToolCallStart(self.index, self.id, name))
        if self._held_args:
            out.append(ToolCallArguments(self.index, "".join(self._held_args)))
            self._held_args.clear()

    def _emit_arguments(self, fragment: str, out: list[OutputEvent]) -> None:
        if not fragment:
            return
        if self.index is None:
            if self.name is None:
                self._held_args.append(fragment)
        else:
            out.append(ToolCallArguments(self.index, fragment))

    def close(self, out: list[OutputEvent]) -> bool:
        """End the call (complete or cut off); False when it never got a name (nothing emitted)."""
        if self.index is None or self.name is None:
            if not self.is_done and self.name is None:
                log.debug("dropping a tool call without a function name")
            return False
        args = self._arguments()
        self._emit_arguments(args.end(), out)
        out.append(ToolCallEnd(self.index, self.id, self.name, args.text))
        return True


class JsonCallsReader(ValueReader):
    """Reads the JSON that holds one or more calls, in any of the shapes models write.

    Shapes: a call object; an array of call objects; `{"tool_calls": [call, ...]}`;
    `{"tool_call": call}`. The reader is done when that JSON value is complete; a value of
    another shape is read to its end and yields no call.
    """

    def __init__(self, next_index: Callable[[], int], new_id: IdFactory, accepts: NamePolicy = any_name) -> None:
        super().__init__()
        self._next_index = next_index
        self._new_id = new_id
        self._accepts = accepts
        self._shape: str | None = None  # "call", "array", "wrapper" or "other"
        self._pending: list[str] = []  # the top object's text until its first key decides the shape
        self._wrapper_key = ""  # the current key of the top object (wrapper shape)
        self._call: CallObjectStream | None = None

    def _step(self, ch: str, out: list[OutputEvent]) -> bool:
        events = self.scanner.step(ch)
        if self.scanner.is_error:
            self.close(out)
            return False
        self._route(ch, events, out)
        return True

    def _route(self, ch: str, events: list[ScanEvent], out: list[OutputEvent]) -> None:
        if self._shape is None:
            self._decide(ch, events, out)
            return
        for event in events:
            if event.kind is Event.KEY and event.depth == 1:
                self._wrapper_key = self.scanner.key
        if self._call is None and self._is_call_start(ch, events):
            self._call = CallObjectStream(self._next_index, self._new_id, self._accepts)
        if self._call is not None:
            self._call.feed(ch, out)
            if self._call.is_done or self._call.is_error:
                self._end_call(out)

    def _decide(self, ch: str, events: list[ScanEvent], out: list[OutputEvent]) -> None:
        if not self._pending and not events:
            return  # whitespace before the value
        self._pending.append(ch)
        first = self._pending[0]
        if first == "[":
            self._shape, self._pending = "array", []
        elif first != "{":
            self._shape = "other"
        elif any(e.kind is Event.KEY for e in events):
            self._wrapper_key = self.scanner.key
            self._shape = "wrapper" if self._wrapper_key in ("tool_calls", "tool_call") else "call"
            if self._shape == "call":
                self._call = CallObjectStream(self._next_index, self._new_id, self._accepts)
                self._call.feed("".join(self._pending), out)
            self._pending = []
        elif self.scanner.is_done:
            self._shape = "other"  # "{}"

    def _is_call_start(self, ch: str, events: list[ScanEvent]) -> bool:
        if ch != "{" or not any(e.kind is Event.VALUE_START for e in events):
            return False
        depth = len(self.scanner.stack) - 1  # the object just opened
        if self._shape == "array":
            return depth == 1
        if self._shape != "wrapper":
            return False
        if self._wrapper_key == "tool_call":
            return depth == 1
        return self._wrapper_key == "tool_calls" and depth == 2 and self.scanner.stack[1] == "["

    def _end_call(self, out: list[OutputEvent]) -> None:
        if self._call is not None:
            self._call.close(out)
        self._call = None

    def close(self, out: list[OutputEvent]) -> None:
        """End at the end of the reply (or on a syntax error): a call in progress is closed."""
        self._end_call(out)


class NamedArgumentsCall(ValueReader):
    """A call whose name came outside the JSON (Mistral's `[TOOL_CALLS]name[ARGS]{...}`):
    only the arguments object is read. Index None: a refused call, read and never emitted."""

    def __init__(self, index: int | None, call_id: str, name: str, out: list[OutputEvent]) -> None:
        super().__init__()
        self.index, self.id, self.name = index, call_id, name
        self._args = ArgumentsStream()
        self._is_started = False  # the arguments value began (whitespace before it is skipped)
        if index is not None:
            out.append(ToolCallStart(index, call_id, name))

    def _step(self, ch: str, out: list[OutputEvent]) -> bool:
        events = self.scanner.step(ch)
        if self.scanner.is_error:
            return False
        self._is_started = self._is_started or bool(events)
        if self._is_started:
            self._emit(self._args.feed(ch), out)
        return True

    def _emit(self, fragment: str, out: list[OutputEvent]) -> None:
        if fragment and self.index is not None:
            out.append(ToolCallArguments(self.index, fragment))

    def close(self, out: list[OutputEvent]) -> None:
        self._emit(self._args.end(), out)
        if self.index is not None:
            out.append(ToolCallEnd(self.index, self.id, self.name, self._args.text))
