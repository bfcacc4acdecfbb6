"""GLM-4.5 / 4.6 / 4.7 tool calls: the name after `<tool_call>`, then key and value tag pairs.

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

(GLM-4.7 writes the same without the line breaks.) Values become JSON by the tool's schema
(xml_calls.py). Reasoning is `<think>` (chat/reasoning.py). The call grammar (`lark_tools`) holds
the function and argument keys to the declared ones; values stay free text.
"""

from __future__ import annotations

import re

from mlxcel.chat.events import OutputEvent
from mlxcel.chat.tools.base import CallsReader, CallStart, Mode, ToolParser, find_marker, partial_suffix_len
from mlxcel.chat.tools.named_grammar import Arguments, Literal, Tools
from mlxcel.chat.tools.xml_calls import (
    Argument, CallEnd, ParameterTypes, Step, TaggedCallReader, blocks_start, tag_pair, tagged_calls,
)  # fmt: skip

START = "<tool_call>"
END = "</tool_call>"
KEY, KEY_END = "<arg_key>", "</arg_key>"
VALUE, VALUE_END = "<arg_value>", "</arg_value>"
ARGUMENTS_KEY = "arguments"
_SPACE = " \t\n\r"


class Glm45CallReader(TaggedCallReader):
    def _read_name(self, text: str) -> tuple[str, int] | CallEnd | None:
        found = find_marker(text.lstrip(_SPACE), ("\n", KEY, END))
        if found is None:
            return None
        skipped = len(text) - len(text.lstrip(_SPACE))
        return text[: skipped + found[0]], skipped + found[0]

    def _read_step(self, text: str) -> Step:
        head = text.lstrip(_SPACE)
        if head.startswith(END):
            return CallEnd(len(text) - len(head))  # the closing tag, dropped by the parser
        if END.startswith(head):
            return None
        key = tag_pair(text, KEY, KEY_END)
        if not isinstance(key, tuple):
            return key
        value = tag_pair(text[key[1] :], VALUE, VALUE_END, ends=(KEY, END))
        if not isinstance(value, tuple):
            return value
        return Argument(key[0].strip(_SPACE), value[0], key[1] + value[1])


class Glm45ToolParser(ToolParser):
    name = "glm45"
    start_markers = (START,)
    reads_parameter_types = True

    def __init__(self, *, parameters: ParameterTypes | None = None, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._types = parameters or {}

    def _scan_start(self, buffer: str) -> CallStart | int:
        at = buffer.find(START)
        return CallStart(at, at + len(START)) if at >= 0 else partial_suffix_len(buffer, (START,))

    def _new_reader(self, buffer: str, out: list[OutputEvent]) -> tuple[CallsReader, int] | None:
        return Glm45CallReader(self._next_index, self.new_id, self.accepts, self._types), 0

    def _scan_after(self, buffer: str) -> tuple[int, Mode] | None:
        # The call ended at (or broke before) its closing tag: drop everything up to it.
        at = buffer.find(END)
        if at >= 0:
            return at + len(END), Mode.CONTENT
        hold = partial_suffix_len(buffer, (END,))
        return (len(buffer) - hold, Mode.AFTER) if len(buffer) > hold else None


# Under tool_choice auto the call grammar starts at the block's opener.
TRIGGER = re.compile(re.escape(START))


def lark_tools(
    tools: Tools, literal: Literal, arguments: Arguments, *, parallel: bool, after_trigger: bool
) -> str:
    """The call grammar (chat/grammar.py): the function and its argument keys are declared ones;
    a value is free text up to `</arg_value>` (the schema's types are not enforced)."""
    start = blocks_start(f"{literal(START)} call {literal(END)}", f"call {literal(END)}", '"\\n"?',
                         parallel=parallel, after_trigger=after_trigger)
    rules = tagged_calls(
        tools, lambda name, arguments: f'{name} {arguments} "\\n"?',
        lambda key: f'{literal(KEY)} {key} {literal(KEY_END)} "\\n"? {literal(VALUE)} value',
        lambda argument: f'("\\n"? {argument})*',
        f'value[suffix="{VALUE_END}"]: /(.|\\n)*/',
    )
    return start + "\n" + rules
