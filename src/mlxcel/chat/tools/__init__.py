"""Tool-call parsers, one module per format, and the choice of format from the chat template.

    name = select_tool_parser(template.source)          # once, at startup; /health reports it
    parser = make_tool_parser(name)                      # one per choice of a request with tools
    events = parser.feed(content_delta) ... parser.finish()
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection
from types import ModuleType

from mlxcel.chat.tools.base import ToolParser

# name -> (module, parser class); modules are imported when first used.
FORMATS: dict[str, tuple[str, str]] = {
    "hermes": ("mlxcel.chat.tools.hermes", "HermesToolParser"),
    "llama3": ("mlxcel.chat.tools.llama3", "Llama3ToolParser"),
    "mistral": ("mlxcel.chat.tools.mistral", "MistralToolParser"),
    "generic": ("mlxcel.chat.tools.generic", "GenericToolParser"),
}


def select_tool_parser(chat_template_source: str | None) -> str:
    """The tool-call format a chat template teaches its model: a key of FORMATS.

    The markers a template prints when it renders tool calls decide: `<tool_call>` (Hermes,
    Qwen), `[TOOL_CALLS]` (Mistral), `<|python_tag|>` or Llama 3 headers with "parameters"
    (Llama 3.x); anything else gets the generic JSON format.
    """
    source = chat_template_source or ""
    if "<tool_call>" in source:
        return "hermes"
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<|python_tag|>" in source or ("<|start_header_id|>" in source and "parameters" in source):
        return "llama3"
    return "generic"


def format_module(name: str) -> ModuleType:
    """The module of a format (it also defines the format's constrained-decoding grammar)."""
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; known: {', '.join(FORMATS)}")
    return importlib.import_module(FORMATS[name][0])


def make_tool_parser(
    name: str, *, new_id: Callable[[], str] | None = None, declared: Collection[str] | None = None
) -> ToolParser:
    """A fresh streaming parser for format `name` (one per generated choice). With `declared`
    (the request's tool names), a call naming another tool stays text (issue 26)."""
    parser_class: type[ToolParser] = getattr(format_module(name), FORMATS[name][1])
    return parser_class(new_id=new_id, declared=declared)


__all__ = ["FORMATS", "ToolParser", "format_module", "make_tool_parser", "select_tool_parser"]
