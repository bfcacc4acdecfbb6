"""DeepSeek-V3 / R1 / V3.1 tool calls, between DeepSeek's own full-width-bar markers.

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>                     (V3, R1)

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>   (V3.1)

Several `<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>` in one block are parallel calls. Reasoning is
`<think>` (chat/reasoning.py). The call grammar (`lark_tools`) allows either spelling of a call.
"""

from __future__ import annotations

import re

from mlxcel.chat.events import OutputEvent
from mlxcel.chat.tools.base import CallsReader, CallStart, Mode, ToolParser, find_marker, partial_suffix_len
from mlxcel.chat.tools.json_stream import NamedArgumentsCall
from mlxcel.chat.tools.named_grammar import Arguments, Literal, Tools, named_calls

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
TYPE = "function"  # V3 / R1 write the call's type before the separator and the name after it
FENCE = "```"
ARGUMENTS_KEY = "arguments"
_SPACE = " \t\n\r"
TRIGGER = re.compile(re.escape(CALLS_BEGIN))  # where a call's grammar starts under tool_choice auto


class DeepSeekToolParser(ToolParser):
    name = "deepseek"
    start_markers = (CALLS_BEGIN, CALL_BEGIN)

    def _scan_start(self, buffer: str) -> CallStart | int:
        found = find_marker(buffer, (CALLS_BEGIN, CALL_BEGIN))
        if found is None:
            return partial_suffix_len(buffer, (CALLS_BEGIN, CALL_BEGIN))
        at, marker = found
        return CallStart(at, at + len(marker))

    def _new_reader(self, buffer: str, out: list[OutputEvent]) -> tuple[CallsReader, int] | None:
        head = buffer.lstrip(_SPACE)
        if CALL_BEGIN.startswith(head):
            return None
        skipped = len(buffer) - len(head) + (len(CALL_BEGIN) if head.startswith(CALL_BEGIN) else 0)
        rest = buffer[skipped:]
        sep = rest.find(SEP)
        if sep < 0:
            return None
        name, used = rest[:sep].strip(_SPACE), skipped + sep + len(SEP)
        if name == TYPE:  # V3 / R1: the name is on the rest of the line, then a ```json fence
            line_end = rest.find("\n", sep)
            if line_end < 0:
                return None
            name, used = rest[sep + len(SEP) : line_end].strip(_SPACE), skipped + line_end + 1
            fence_end = _after_fence(buffer[used:])
            if fence_end is None:
                return None
            used += fence_end
        if not self.accepts(name):
            return NamedArgumentsCall(None, "", name, out), used
        return NamedArgumentsCall(self._next_index(), self.new_id(), name, out), used

    def _scan_after(self, buffer: str) -> tuple[int, Mode] | None:
        # After the arguments: the fence's end and `<｜tool▁call▁end｜>`, then the block's next call
        # (which _scan_start reads) or its end; anything else is content again.
        head = buffer.lstrip(_SPACE)
        skipped = len(buffer) - len(head)
        for marker, mode in ((CALLS_END, Mode.CONTENT), (CALL_END, Mode.AFTER), (FENCE, Mode.AFTER)):
            if head.startswith(marker):
                return skipped + len(marker), mode
        if head.startswith(CALL_BEGIN):
            return skipped, Mode.CONTENT
        if any(m.startswith(head) for m in (CALLS_END, CALL_END, FENCE, CALL_BEGIN)):
            return None
        return 0, Mode.CONTENT


def _after_fence(text: str) -> int | None:
    """Where the JSON starts after an optional ```json line (None: wait)."""
    head = text.lstrip(_SPACE)
    skipped = len(text) - len(head)
    if not head.startswith(FENCE):
        return None if FENCE.startswith(head) else 0
    line_end = head.find("\n")
    if line_end < 0:
        return None if len(head) < len(FENCE) + 8 else 0
    return skipped + line_end + 1


def lark_tools(
    tools: Tools, literal: Literal, arguments: Arguments, *, parallel: bool, after_trigger: bool
) -> str:
    """The call grammar (chat/grammar.py): a block of calls (one without parallel calls), each in
    the V3 / R1 spelling or the V3.1 one; after TRIGGER, the block without its opener."""
    one = f"{literal(CALL_BEGIN)} call {literal(CALL_END)}"
    block = (f'{one} ("\\n"? {one})*' if parallel else one) + f" {literal(CALLS_END)}"
    start = f"start: {block}" if after_trigger else f"start: {literal(CALLS_BEGIN)} {block}"
    sep = literal(SEP)

    def spell(name: str, args: str) -> str:
        return f'("{TYPE}" {sep} {name} "\\n```json\\n" {args} "\\n```" | {name} {sep} {args})'

    return start + "\n" + named_calls(tools, arguments, spell)
