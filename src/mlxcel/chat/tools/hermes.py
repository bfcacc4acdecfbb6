"""Hermes / Qwen tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.

Used by Qwen 2.5/3, Hermes 2/3 and most templates that print `<tool_call>`. Several blocks in a
row are parallel calls. Text between or around blocks is content.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from mlxcel.chat.tools.base import CallStart, Mode, ToolParser, find_marker, partial_suffix_len

START = "<tool_call>"
END = "</tool_call>"
TRIGGER = re.compile(re.escape(START))  # where a call's grammar starts under tool_choice auto


class HermesToolParser(ToolParser):
    name = "hermes"
    start_markers = (START,)

    def _scan_start(self, buffer: str) -> CallStart | int:
        at = buffer.find(START)
        if at >= 0:
            return CallStart(at, at + len(START))
        return partial_suffix_len(buffer, (START,))

    def _scan_after(self, buffer: str) -> tuple[int, Mode] | None:
        # The block's JSON ended (or broke): drop everything up to </tool_call>. A model that
        # forgets the closing tag and opens the next call goes straight on to that call.
        found = find_marker(buffer, (END, START))
        if found is None:
            hold = partial_suffix_len(buffer, (END, START))
            return (len(buffer) - hold, Mode.AFTER) if len(buffer) > hold else None
        at, marker = found
        return (at + len(END), Mode.CONTENT) if marker == END else (at, Mode.CONTENT)


ARGUMENTS_KEY = "arguments"


def lark_calls(call: str, literal: Callable[[str], str], *, parallel: bool) -> str:
    """Lark for the whole reply when a call is required; `call` is the rule of one call object
    (`literal` spells a marker, as text or as its special token)."""
    block = f'{literal(START)} "\\n" {call} "\\n" {literal(END)}'
    return f'{block} ("\\n" {block})*' if parallel else block


def lark_after_trigger(call: str, literal: Callable[[str], str], *, parallel: bool) -> str:
    """Lark for what follows TRIGGER when calls are optional: one call and its closing tag
    (`literal` spells a marker, as text or as its special token)."""
    return f'"\\n"? {call} "\\n"? {literal(END)}'
