"""Hermes / Qwen tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.

Used by Qwen 2.5/3, Hermes 2/3 and most templates that print `<tool_call>`. Several blocks in a
row are parallel calls. Text between or around blocks is content.

Small Qwen2.5-Coder models often drop the tags and open the reply with the bare call object (issue 46:
Claude Code's run then ended on a reply whose text was a call). When the request declared tools, a
reply (or the text after a call) that opens with `{"name": <a declared tool>` is that call, as
llama.cpp's Hermes parser also takes it; any other JSON stays text.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from mlxcel.chat.tools.base import (
    CallStart, Mode, Prefix, ToolParser, find_marker, is_cut_json_call, json_call_prefix, partial_suffix_len,
)

START = "<tool_call>"
END = "</tool_call>"
BARE_FIRST_KEYS = ("name",)  # a tagless call object: {"name": ..., "arguments": {...}}
# ChatML's turn opener, which a confused small model may print before a bare call (the tokenizer renders
# special tokens as text): markup there, as the line after it.
TURN_OPENER, ROLE = "<|im_start|>", "assistant"
TRIGGER = re.compile(re.escape(START))  # where a call's grammar starts under tool_choice auto


class HermesToolParser(ToolParser):
    name = "hermes"
    start_markers = (START,)

    def _scan_start(self, buffer: str) -> CallStart | int:
        at = buffer.find(START)
        if at >= 0:
            return CallStart(at, at + len(START))
        if self._declared and not self._is_content_seen:  # a bare call opens the reply or follows a call
            opening = _turn_opening(buffer)
            if opening is None:
                return len(buffer)
            verdict, json_at = json_call_prefix(buffer[opening:], BARE_FIRST_KEYS, allow_array=False)
            if verdict is Prefix.YES:
                return CallStart(0, opening + json_at, is_bare=True)
            if verdict is Prefix.MAYBE:
                return len(buffer)
        return partial_suffix_len(buffer, (START,))

    def _final_content(self, held: str) -> str:
        if self._declared and not self._is_content_seen and is_cut_json_call(held, BARE_FIRST_KEYS):
            return ""  # a bare call cut off before it named its tool
        return super()._final_content(held)

    def _scan_after(self, buffer: str) -> tuple[int, Mode] | None:
        if self._is_bare and not self._is_fenced:
            return 0, Mode.CONTENT  # a bare call has no closing tag
        # The block's JSON ended (or broke): drop everything up to </tool_call>. A model that
        # forgets the closing tag and opens the next call goes straight on to that call.
        found = find_marker(buffer, (END, START))
        if found is None:
            hold = partial_suffix_len(buffer, (END, START))
            return (len(buffer) - hold, Mode.AFTER) if len(buffer) > hold else None
        at, marker = found
        return (at + len(END), Mode.CONTENT) if marker == END else (at, Mode.CONTENT)


def _turn_opening(buffer: str) -> int | None:
    """How much of `buffer` is leading space and a ChatML turn opener (`<|im_start|>`, perhaps its
    role) before a possible bare call; None while the text may still be growing into one."""
    text = buffer.lstrip()
    if not text.startswith(TURN_OPENER):
        return None if text and TURN_OPENER.startswith(text) else len(buffer) - len(text)
    after = text[len(TURN_OPENER):]
    if ROLE.startswith(after):
        return None
    return len(buffer) - len(after.removeprefix(ROLE))


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
