"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`.

Llama 3.1-3.3 write a call as a bare JSON object at the start of the reply (or after the
`<|python_tag|>` token); several calls are separated by `;` or whitespace. `"arguments"` is
accepted in place of `"parameters"`, and the OpenAI shape `{"type": "function", ...}` too.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from mlxcel.chat.tools.base import (
    CallStart, Mode, Prefix, ToolParser, is_cut_json_call, json_call_prefix, partial_suffix_len,
)

PYTHON_TAG = "<|python_tag|>"
FIRST_KEYS = ("name", "type", "function")
ARGUMENTS_KEY = "parameters"
# Where a call's grammar starts under tool_choice auto; a bare JSON call has no reliable opener,
# so only its parser's check of the name applies.
TRIGGER = re.compile(re.escape(PYTHON_TAG))


class Llama3ToolParser(ToolParser):
    name = "llama3"
    start_markers = (PYTHON_TAG,)

    def _scan_start(self, buffer: str) -> CallStart | int:
        at = buffer.find(PYTHON_TAG)
        if at >= 0:
            return CallStart(at, at + len(PYTHON_TAG))
        if not self._is_content_seen:  # a bare JSON call only opens the reply or follows a call
            verdict, json_at = json_call_prefix(buffer.lstrip(" \t\n\r;"), FIRST_KEYS, allow_array=False)
            json_at += len(buffer) - len(buffer.lstrip(" \t\n\r;"))
            if verdict is Prefix.YES:
                return CallStart(0, json_at, is_bare=True)
            if verdict is Prefix.MAYBE:
                return len(buffer)
        return partial_suffix_len(buffer, (PYTHON_TAG,))

    def _final_content(self, held: str) -> str:
        body = held.lstrip(" \t\n\r;")
        if self.num_calls and json_call_prefix(body, FIRST_KEYS, allow_array=False)[0] is Prefix.MAYBE:
            return ""  # separators (and perhaps a brace) after a call
        if is_cut_json_call(body, FIRST_KEYS):
            return ""
        return super()._final_content(held)

    def _scan_after(self, buffer: str) -> tuple[int, Mode] | None:
        return 0, Mode.CONTENT


def lark_calls(call: str, literal: Callable[[str], str], *, parallel: bool) -> str:  # noqa: ARG001 (no markers)
    """Lark for the whole reply when a call is required; `call` is the rule of one call object."""
    return f'{call} ("; " {call})*' if parallel else call


def lark_after_trigger(call: str, literal: Callable[[str], str], *, parallel: bool) -> str:
    """Lark for what follows TRIGGER when calls are optional."""
    return lark_calls(call, literal, parallel=parallel)
