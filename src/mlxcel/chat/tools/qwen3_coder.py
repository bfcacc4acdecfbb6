"""Qwen3-Coder tool calls: XML tags, one per argument, values as text.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value's own first and last line break are markup; a model that leaves out `</parameter>`
(or the `<tool_call>` opener) is read all the same. Values become JSON by the tool's schema
(xml_calls.py). The call grammar (`lark_tools`) holds the function and parameter names to the
declared ones; values stay free text.
"""

from __future__ import annotations

import re

from mlxcel.chat.events import OutputEvent
from mlxcel.chat.tools.base import CallsReader, CallStart, Mode, ToolParser, find_marker, partial_suffix_len
from mlxcel.chat.tools.named_grammar import Arguments, Literal, Tools
from mlxcel.chat.tools.xml_calls import (
    Argument, CallEnd, ParameterTypes, Step, TaggedCallReader, blocks_start, strip_one_newline, tagged_calls,
)  # fmt: skip

START = "<tool_call>"
END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
ARGUMENTS_KEY = "arguments"
_SPACE = " \t\n\r"


class Qwen3CoderCallReader(TaggedCallReader):
    def _read_name(self, text: str) -> tuple[str, int] | CallEnd | None:
        return _tag_attribute(text, FUNCTION)

    def _read_step(self, text: str) -> Step:
        head = text.lstrip(_SPACE)
        skipped = len(text) - len(head)
        if head.startswith(FUNCTION_END):
            return CallEnd(skipped + len(FUNCTION_END))
        if head.startswith(END):
            return CallEnd(skipped)  # the block's closing tag, dropped by the parser
        if any(m.startswith(head) for m in (FUNCTION_END, END, PARAMETER)):
            return None
        key = _tag_attribute(head, PARAMETER)
        if not isinstance(key, tuple):
            return key
        name, at = key
        body = head[at:]
        found = find_marker(body, (PARAMETER_END, PARAMETER, FUNCTION_END))
        if found is None:
            return None
        end, marker = found
        used = skipped + at + end + (len(PARAMETER_END) if marker == PARAMETER_END else 0)
        return Argument(name, strip_one_newline(body[:end]), used)


def _tag_attribute(text: str, opener: str) -> tuple[str, int] | CallEnd | None:
    """`<opener>VALUE>` at the start of `text` (after whitespace): VALUE and the characters taken."""
    head = text.lstrip(_SPACE)
    if not head.startswith(opener):
        return None if opener.startswith(head) else CallEnd(0)
    end = head.find(">", len(opener))
    if end < 0:
        return None
    return head[len(opener) : end], len(text) - len(head) + end + 1


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    start_markers = (START, FUNCTION)
    reads_parameter_types = True

    def __init__(self, *, parameters: ParameterTypes | None = None, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._types = parameters or {}

    def _scan_start(self, buffer: str) -> CallStart | int:
        found = find_marker(buffer, (START, FUNCTION))
        if found is None:
            return partial_suffix_len(buffer, (START, FUNCTION))
        at, marker = found
        return CallStart(at, at + len(START) if marker == START else at)

    def _new_reader(self, buffer: str, out: list[OutputEvent]) -> tuple[CallsReader, int] | None:
        return Qwen3CoderCallReader(self._next_index, self.new_id, self.accepts, self._types), 0

    def _scan_after(self, buffer: str) -> tuple[int, Mode] | None:
        head = buffer.lstrip(_SPACE)
        if head.startswith(END):
            return len(buffer) - len(head) + len(END), Mode.CONTENT
        if END.startswith(head):
            return None
        return 0, Mode.CONTENT



# Under tool_choice auto the call grammar starts at the block's opener.
TRIGGER = re.compile(re.escape(START))


def lark_tools(
    tools: Tools, literal: Literal, arguments: Arguments, *, parallel: bool, after_trigger: bool
) -> str:
    """The call grammar (chat/grammar.py): the function and its parameters are declared ones; a
    value is free text up to its closing tag (the schema's types are not enforced: values are
    not JSON here)."""
    start = blocks_start(f'{literal(START)} "\\n" call "\\n" {literal(END)}', f'"\\n"? call "\\n"? {literal(END)}',
                         '"\\n"', parallel=parallel, after_trigger=after_trigger)
    rules = tagged_calls(
        tools, lambda name, arguments: f'"{FUNCTION}" {name} ">\\n" {arguments} "{FUNCTION_END}"',
        lambda key: f'"{PARAMETER}" {key} ">\\n" value', lambda argument: f"{argument}*",
        'value[suffix="\\n</parameter>\\n"]: /(.|\\n)*/',
    )
    return start + "\n" + rules
