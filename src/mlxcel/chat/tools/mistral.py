"""Mistral tool calls: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`.

Also read: a single object after `[TOOL_CALLS]`, and the newer (v11+ tokenizer) form
`[TOOL_CALLS]name[ARGS]{...}` (one call per `[TOOL_CALLS]`). Mistral templates require call
ids of exactly 9 letters and digits, so this parser makes those.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable

from mlxcel.chat.events import OutputEvent
from mlxcel.chat.tools.base import CallsReader, CallStart, ToolParser, partial_suffix_len
from mlxcel.chat.tools.json_stream import JsonCallsReader, NamedArgumentsCall

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
ARGUMENTS_KEY = "arguments"
TRIGGER = re.compile(re.escape(TOOL_CALLS))  # where a call's grammar starts under tool_choice auto
_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


class MistralToolParser(ToolParser):
    name = "mistral"
    start_markers = (TOOL_CALLS,)

    @staticmethod
    def default_id() -> str:
        return mistral_call_id()

    def _scan_start(self, buffer: str) -> CallStart | int:
        at = buffer.find(TOOL_CALLS)
        if at >= 0:
            return CallStart(at, at + len(TOOL_CALLS))
        return partial_suffix_len(buffer, (TOOL_CALLS,))

    def _new_reader(self, buffer: str, out: list[OutputEvent]) -> tuple[CallsReader, int] | None:
        head = buffer.lstrip(" \t\n\r")
        if not head:
            return None
        if head[0] in "[{":
            return JsonCallsReader(self._next_index, self.new_id, self.accepts), 0
        return self._named_call(buffer, out)

    def _named_call(self, buffer: str, out: list[OutputEvent]) -> tuple[CallsReader, int] | None:
        # `name[ARGS]{...}`, `name[CALL_ID]id[ARGS]{...}` or `name{...}`: wait for the arguments.
        at = buffer.find(ARGS)
        end = at if at >= 0 else buffer.find("{")
        if end < 0:
            return None
        name = buffer[:end].split(CALL_ID)[0].strip()
        used = end + len(ARGS) if at >= 0 else end
        if not self.accepts(name):
            return NamedArgumentsCall(None, "", name, out), used
        return NamedArgumentsCall(self._next_index(), self.new_id(), name, out), used


def lark_calls(call: str, literal: Callable[[str], str], *, parallel: bool) -> str:
    """Lark for the whole reply when a call is required; `call` is the rule of one call object."""
    items = f'{call} (", " {call})*' if parallel else call
    return f'{literal(TOOL_CALLS)} "[" {items} "]"'


def lark_after_trigger(call: str, literal: Callable[[str], str], *, parallel: bool) -> str:
    """Lark for what follows TRIGGER when calls are optional: the array of calls."""
    items = f'{call} (", " {call})*' if parallel else call
    return f'" "? "[" {items} "]"'
