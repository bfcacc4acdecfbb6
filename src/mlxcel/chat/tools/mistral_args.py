"""Mistral tool calls as newer templates (v11+ tokenizers: Mistral Small 3.2, Magistral, Devstral,
Ministral) print them: `[TOOL_CALLS]name[ARGS]{...}`, one call per `[TOOL_CALLS]`.

The parser is mistral.py's (it reads both this form and the JSON list); what differs is the call
grammar, which writes the form the template teaches instead of the list.
"""

from __future__ import annotations

from mlxcel.chat.tools.mistral import ARGS, ARGUMENTS_KEY, TOOL_CALLS, TRIGGER, MistralToolParser
from mlxcel.chat.tools.named_grammar import Arguments, Literal, Tools, named_calls


class MistralArgsToolParser(MistralToolParser):
    name = "mistral_args"


def lark_tools(
    tools: Tools, literal: Literal, arguments: Arguments, *, parallel: bool, after_trigger: bool
) -> str:
    """The call grammar (chat/grammar.py): `[TOOL_CALLS]name[ARGS]{...}`, repeated for parallel
    calls; after TRIGGER, one call (the next `[TOOL_CALLS]` triggers the next)."""
    opener = literal(TOOL_CALLS)
    start = "start: call" if after_trigger else f"start: {opener} call" + (f" ({opener} call)*" if parallel else "")
    return start + "\n" + named_calls(tools, arguments, lambda name, args: f"{name} {literal(ARGS)} {args}")


__all__ = ["ARGUMENTS_KEY", "TRIGGER", "MistralArgsToolParser", "lark_tools"]
