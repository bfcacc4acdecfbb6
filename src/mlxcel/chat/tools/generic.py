"""Generic JSON tool calls, for templates that teach no format of their own.

The reply is a JSON value at its very start (optionally in a ```json fence): a call object
`{"name": ..., "arguments": {...}}`, an array of them, `{"tool_call": call}` or
`{"tool_calls": [call, ...]}` (llama.cpp's generic format). Anything else is content.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from mlxcel.chat.tools.base import CallStart, Mode, Prefix, ToolParser, is_cut_json_call, json_call_prefix

FIRST_KEYS = ("tool_calls", "tool_call", "name", "type", "function")
FENCES = ("```json", "```")
ARGUMENTS_KEY = "arguments"
# Under tool_choice auto, the grammar starts where a reply opens the wrapper the prompt shows
# (template_polyfill.EXAMPLE_CALL), fenced or not; other shapes have no reliable opener, so only
# the parser's check of the name applies to them.
TRIGGER = re.compile(r'\A\s*(?:```(?:json)?\s*)?\{\s*"tool_calls"\s*:\s*\[')
_SPACE = " \t\n\r"


class GenericToolParser(ToolParser):
    name = "generic"

    def _scan_start(self, buffer: str) -> CallStart | int:
        if self._is_content_seen or self.num_calls:
            return 0  # calls only open the reply
        body = _skip_fence(buffer)
        if body is None:
            return len(buffer)  # could still be an opening fence
        verdict, json_at = json_call_prefix(buffer[body:], FIRST_KEYS)
        if verdict is Prefix.YES:
            return CallStart(0, body + json_at, is_bare=True)
        return len(buffer) if verdict is Prefix.MAYBE else 0

    def _final_content(self, held: str) -> str:
        body = _skip_fence(held)
        if body is None:
            return ""  # a cut-off opening fence
        rest = held[body:]
        if body and json_call_prefix(rest, FIRST_KEYS)[0] is Prefix.MAYBE:
            return ""  # a fence, then perhaps a call
        return "" if is_cut_json_call(rest, FIRST_KEYS) else held

    def _scan_after(self, buffer: str) -> tuple[int, Mode] | None:
        head = buffer.lstrip(_SPACE)
        if len(head) < 3 and "```".startswith(head):
            return None  # maybe the closing fence
        skipped = len(buffer) - len(head)
        return (skipped + 3, Mode.CONTENT) if head.startswith("```") else (0, Mode.CONTENT)


def _skip_fence(buffer: str) -> int | None:
    """Where the JSON may begin: after an opening fence if there is one (None: undecided)."""
    head = buffer.lstrip(_SPACE)
    start = len(buffer) - len(head)
    for fence in FENCES:
        if head.startswith(fence):
            return start + len(fence)
        if fence.startswith(head) and head:
            return None
    return 0


def lark_calls(call: str, literal: Callable[[str], str], *, parallel: bool) -> str:  # noqa: ARG001 (no markers)
    """Lark for the whole reply when a call is required; `call` is the rule of one call object."""
    items = f'{call} (", " {call})*' if parallel else call
    return f'"{{\\"tool_calls\\": [" {items} "]}}"'


def lark_after_trigger(call: str, literal: Callable[[str], str], *, parallel: bool) -> str:
    """Lark for what follows TRIGGER when calls are optional: the calls and the wrapper's end."""
    items = f'{call} (", " {call})*' if parallel else call
    return f'{items} "]}}"'
