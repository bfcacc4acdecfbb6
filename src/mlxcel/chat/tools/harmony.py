"""gpt-oss (harmony) tool calls: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`.

chat/harmony.py's splitter has already taken the reply apart into messages; a message with a
recipient reaches this parser in the canonical spelling above (the recipient may have been in
the role part of the header, and `<|call|>` is a stop token the text never shows). The
recipient's `functions.` namespace is dropped from the name; a built-in tool's recipient
(`python`, `browser.search`) names no declared function, so it stays text.

Not constrained: harmony puts the name in the header, outside the JSON that the shared call
grammar (chat/grammar.py) describes, so `tool_choice` required is refused and auto is free text.
"""

from __future__ import annotations

from mlxcel.chat.events import OutputEvent
from mlxcel.chat.harmony import CALL, CALL_OPENER, END, MESSAGE
from mlxcel.chat.tools.base import CallsReader, CallStart, Mode, ToolParser, partial_suffix_len
from mlxcel.chat.tools.json_stream import NamedArgumentsCall

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
