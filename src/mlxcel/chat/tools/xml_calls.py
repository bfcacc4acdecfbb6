"""Calls written as tags, one argument per tag pair (Qwen3-Coder, GLM-4.5): the shared reader.

The model writes each argument's value as text, not JSON: a string as it is, anything else as
JSON (the templates print `v | tojson` unless `v` is a string). So a value becomes a string when
the tool's schema says the parameter is one, else JSON when it parses as JSON, else a string.
Arguments stream as JSON fragments, one per finished argument: `{"a": 1`, `, "b": "x"`, `}`.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mlxcel.chat.events import OutputEvent, ToolCallArguments, ToolCallEnd, ToolCallStart

_SPACE = " \t\n\r"


@dataclass(frozen=True, slots=True)
class Argument:
    """One finished argument tag pair and how many characters it took."""

    key: str
    value: str
    used: int


@dataclass(frozen=True, slots=True)
class CallEnd:
    """The call's closing tag (or the block's, when the model left the call's out); `used`: the
    characters it takes, 0 where the tag belongs to the block (dropped by the parser after it)."""

    used: int


Step = Argument | CallEnd | None  # None: wait for more text
ParameterTypes = Mapping[str, Mapping[str, Any]]  # tool name -> parameter name -> its JSON Schema


def parameter_types(tools: Sequence[Any] | None) -> dict[str, dict[str, Any]]:
    """Each function tool's parameter schemas (`properties`), in the OpenAI chat, Responses or
    Anthropic shape; malformed entries are skipped (the grammar's check refuses them first)."""
    found: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            continue
        function = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
        schema = function.get("parameters", function.get("input_schema"))
        properties = schema.get("properties") if isinstance(schema, Mapping) else None
        if isinstance(function.get("name"), str) and isinstance(properties, Mapping):
            found[function["name"]] = dict(properties)
    return found


def argument_value(text: str, schema: Mapping[str, Any] | None) -> Any:
    """An argument's value from its text: a string where the schema says so, else JSON if it
    parses, else the text."""
    types = schema.get("type") if isinstance(schema, Mapping) else None
    is_string = types == "string" or (isinstance(types, list) and "string" in types and len(types) == 1)
    if is_string:
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


class TaggedCallReader(abc.ABC):
    """Reads one call (its name, then argument tag pairs up to the call's end) and emits its
    events; a CallsReader for tools/base.py. Formats define `_read_name` and `_read_step`."""

    def __init__(
        self, next_index: Callable[[], int], new_id: Callable[[], str], accepts: Callable[[str], bool],
        types: ParameterTypes,
    ) -> None:
        self._next_index, self._new_id, self._accepts = next_index, new_id, accepts
        self._types = types
        self._index: int | None = None  # None: no name yet, or a refused call (emits nothing)
        self._name: str | None = None
        self._id = ""
        self._arguments = ""  # the JSON text emitted so far
        self.is_done = False
        self.is_error = False

    def feed(self, text: str, out: list[OutputEvent]) -> int:
        used = 0
        while not (self.is_done or self.is_error):
            step = self._advance(text[used:], out)
            if step is None:
                break
            used += step
        return used

    def _advance(self, text: str, out: list[OutputEvent]) -> int | None:
        if self._name is None:
            found = self._read_name(text)
            if found is None:
                return None
            if isinstance(found, CallEnd):
                self.is_error = True  # no name: the markup was text
                return 0
            name, used = found
            self._start(name.strip(_SPACE), out)
            return used
        step = self._read_step(text)
        if step is None:
            return None
        if isinstance(step, CallEnd):
            self.is_done = True
        else:
            self._add(step, out)
        return step.used

    def _start(self, name: str, out: list[OutputEvent]) -> None:
        self._name = name
        if not name:
            self.is_error = True
            return
        if self._accepts(name):
            self._index, self._id = self._next_index(), self._new_id()
            out.append(ToolCallStart(self._index, self._id, name))

    def _add(self, argument: Argument, out: list[OutputEvent]) -> None:
        schema = self._types.get(self._name or "", {}).get(argument.key)
        value = argument_value(argument.value, schema)
        pair = f"{json.dumps(argument.key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        self._emit(("{" if not self._arguments else ", ") + pair, out)

    def _emit(self, fragment: str, out: list[OutputEvent]) -> None:
        self._arguments += fragment
        if self._index is not None:
            out.append(ToolCallArguments(self._index, fragment))

    def close(self, out: list[OutputEvent]) -> None:
        """The call is over (its end tag, or the end of the reply): close the arguments object."""
        if self._name is None or not self._name:
            return
        self._emit("}" if self._arguments else "{}", out)
        if self._index is not None:
            out.append(ToolCallEnd(self._index, self._id, self._name, self._arguments))

    @abc.abstractmethod
    def _read_name(self, text: str) -> tuple[str, int] | CallEnd | None:
        """The function name at the start of `text` and the characters it took (CallEnd: the
        text is no call; None: wait)."""

    @abc.abstractmethod
    def _read_step(self, text: str) -> Step:
        """The next argument, or the call's end, at the start of `text` (None: wait)."""


def tag_pair(text: str, opener: str, closer: str, ends: Sequence[str] = ()) -> tuple[str, int] | CallEnd | None:
    """`opener` VALUE `closer` at the start of `text` (after whitespace): VALUE and the characters
    taken. A VALUE that runs into one of `ends` first (the model left `closer` out) ends there.
    CallEnd(0): `text` opens something else; None: wait for more text."""
    head = text.lstrip(_SPACE)
    skipped = len(text) - len(head)
    if not head.startswith(opener):
        return None if opener.startswith(head) else CallEnd(0)
    body = head[len(opener) :]
    at = body.find(closer)
    cut = [i for i in (body.find(e) for e in ends) if i >= 0]
    if cut and (at < 0 or min(cut) < at):
        return body[: min(cut)], skipped + len(opener) + min(cut)
    if at < 0:
        return None
    return body[:at], skipped + len(opener) + at + len(closer)


def strip_one_newline(value: str) -> str:
    """A value on lines of its own (`>\\nvalue\\n<`) without those two line breaks."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


# --- the call grammar: declared function and parameter names, values free text ---------------


def tagged_calls(
    tools: Sequence[tuple[str, Mapping[str, Any]]], spell_call: Callable[[str, str], str],
    spell_argument: Callable[[str], str], repeat: Callable[[str], str], value: str,
) -> str:
    """Lark rules: `call` is one of the tools, spelled by `spell_call(name literal, its arguments)`;
    the arguments are `repeat(rule of one argument)`, each spelled by `spell_argument(key rule)`;
    `value` is the Lark of the free-text value rule (ending at the format's closing tag). Keys are
    the schema's properties; a schema without `properties` takes any key, one with none takes none."""
    lines = ["call: " + " | ".join(f"tool_{i}" for i in range(len(tools)))]
    for i, (name, parameters) in enumerate(tools):
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        if isinstance(properties, Mapping) and not properties:
            lines.append(f"tool_{i}: {spell_call(json.dumps(name), '')}")
            continue
        keys = " | ".join(json.dumps(k) for k in properties) if isinstance(properties, Mapping) else ""
        lines.append(f"tool_{i}: {spell_call(json.dumps(name), repeat(f'argument_{i}'))}")
        lines.append(f"argument_{i}: {spell_argument(f'({keys})' if keys else 'any_key')}")
    lines += ["any_key: /[A-Za-z0-9_.-]+/", value]
    return "\n".join(lines) + "\n"


def blocks_start(block: str, after_trigger_start: str, between: str, *, parallel: bool, after_trigger: bool) -> str:
    """The `start` rule: one call `block` (several, `between` them, for parallel calls), or
    `after_trigger_start` for what follows the lazy grammar's trigger."""
    if after_trigger:
        return f"start: {after_trigger_start}"
    return f"start: {block}" + (f" ({between} {block})*" if parallel else "")
