"""gpt-oss (harmony) tool calls: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`.

chat/harmony.py's splitter has already taken the reply apart into messages; a message with a
recipient reaches this parser in the canonical spelling above (the recipient may have been in
the role part of the header, and `<|call|>` is a stop token the text never shows). The
recipient's `functions.` namespace is dropped from the name; a built-in tool's recipient
(`python`, `browser.search`) names no declared function, so it stays text.

The call grammar (`lark_tools`) names a declared function and fits its arguments to the schema.
"""

from __future__ import annotations

import re

from mlxcel.chat.events import OutputEvent
from mlxcel.chat.harmony import CALL, CALL_OPENER, CHANNEL, CONSTRAIN, END, MESSAGE, START
from mlxcel.chat.tools.base import CallsReader, CallStart, Mode, ToolParser, partial_suffix_len
from mlxcel.chat.tools.json_stream import NamedArgumentsCall
from mlxcel.chat.tools.named_grammar import Arguments, Literal, Tools, named_calls

NAMESPACE = "functions."
ARGUMENTS_KEY = "arguments"
_SPACE = " \t\n\r"


class HarmonyToolParser(ToolParser):
    name = "harmony"
    start_markers = (CALL_OPENER,)

    def _scan_start(self, buffer: str) -> CallStart | int:
        at = buffer.find(CALL_OPENER)
        if at >= 0:
            return CallStart(at, at + len(CALL_OPENER))
        return partial_suffix_len(buffer, (CALL_OPENER,))

    def _new_reader(self, buffer: str, out: list[OutputEvent]) -> tuple[CallsReader, int] | None:
        at = buffer.find(MESSAGE)
        if at < 0:
            return None
        recipient = buffer[:at].split(maxsplit=1)[0] if buffer[:at].strip() else ""
        name = recipient.removeprefix(NAMESPACE)
        used = at + len(MESSAGE)
        if not self.accepts(name):
            return NamedArgumentsCall(None, "", name, out), used
        return NamedArgumentsCall(self._next_index(), self.new_id(), name, out), used

    def _scan_after(self, buffer: str) -> tuple[int, Mode] | None:
        # The arguments ended: drop what is left of the message up to its `<|call|>`.
        for marker in (CALL, END):
            at = buffer.find(marker)
            if at >= 0:
                return at + len(marker), Mode.CONTENT
        hold = partial_suffix_len(buffer, (CALL, END))
        return (len(buffer) - hold, Mode.AFTER) if len(buffer) > hold else None


# Under tool_choice auto the call grammar starts after the recipient's namespace (in the role or
# the channel part of the header; the reasoning before it is never scanned).
TRIGGER = re.compile(re.escape("to=" + NAMESPACE))


def lark_tools(
    tools: Tools, literal: Literal, arguments: Arguments, *, parallel: bool, after_trigger: bool
) -> str:
    """The call grammar (chat/grammar.py): a required call is one commentary message to a
    function (its `<|call|>` ends the reply, so one call a turn); after TRIGGER, the name and the
    rest of its header wherever the recipient stood."""
    if after_trigger:
        header = f'({literal(CHANNEL)} "commentary")? (" "? {literal(CONSTRAIN)} "json" | " json")? {literal(MESSAGE)}'
        start = "start: call"
    else:
        header = f'" " {literal(CONSTRAIN)} "json" {literal(MESSAGE)}'
        start = f'start: {literal(START)} "assistant" {literal(CHANNEL)} "commentary to={NAMESPACE}" call'
    return start + "\n" + named_calls(tools, arguments, lambda name, args: f"{name} {header} {args}")
