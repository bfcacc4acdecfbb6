"""Tool-call parsers, one module per format, and the choice of format from the chat template.

    name = select_tool_parser(template.source)          # once, at startup; /health reports it
    parser = make_tool_parser(name)                      # one per choice of a request with tools
    events = parser.feed(content_delta) ... parser.finish()
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Mapping, Sequence
from types import ModuleType
from typing import Any

from mlxcel.chat.tools.base import ToolParser
from mlxcel.chat.tools.xml_calls import parameter_types

# name -> (module, parser class); modules are imported when first used.
FORMATS: dict[str, tuple[str, str]] = {
    "hermes": ("mlxcel.chat.tools.hermes", "HermesToolParser"),
    "llama3": ("mlxcel.chat.tools.llama3", "Llama3ToolParser"),
    "mistral": ("mlxcel.chat.tools.mistral", "MistralToolParser"),
    "mistral_args": ("mlxcel.chat.tools.mistral_args", "MistralArgsToolParser"),
    "generic": ("mlxcel.chat.tools.generic", "GenericToolParser"),
    "harmony": ("mlxcel.chat.tools.harmony", "HarmonyToolParser"),
    "deepseek": ("mlxcel.chat.tools.deepseek", "DeepSeekToolParser"),
    "qwen3_coder": ("mlxcel.chat.tools.qwen3_coder", "Qwen3CoderToolParser"),
    "glm45": ("mlxcel.chat.tools.glm45", "Glm45ToolParser"),
}


def select_tool_parser(chat_template_source: str | None) -> str:
    """The tool-call format a chat template teaches its model: a key of FORMATS.

    The markers a template prints when it renders tool calls decide: harmony's `<|channel|>`
    and `<|message|>` (gpt-oss), DeepSeek's `<｜tool▁calls▁begin｜>`, `<function=` tags (Qwen3-Coder)
    and `<arg_key>` tags (GLM-4.5) inside `<tool_call>`, else `<tool_call>` (Hermes, Qwen),
    `[TOOL_CALLS]` (Mistral; with `[ARGS]`, the newer name-first form), `<|python_tag|>` or
    Llama 3 headers with "parameters" (Llama 3.x); anything else gets the generic JSON format.
    """
    source = chat_template_source or ""
    if "<|channel|>" in source and "<|message|>" in source:
        return "harmony"
    if "<｜tool▁calls▁begin｜>" in source:
        return "deepseek"
    if "<function=" in source and "<parameter=" in source:
        return "qwen3_coder"
    if "<arg_key>" in source:
        return "glm45"
    if "<tool_call>" in source:
        return "hermes"
    if "[TOOL_CALLS]" in source:
        return "mistral_args" if "[ARGS]" in source else "mistral"
    if "<|python_tag|>" in source or ("<|start_header_id|>" in source and "parameters" in source):
        return "llama3"
    return "generic"


def format_module(name: str) -> ModuleType:
    """The module of a format (it also defines the format's constrained-decoding grammar)."""
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; known: {', '.join(FORMATS)}")
    return importlib.import_module(FORMATS[name][0])


def make_tool_parser(
    name: str, *, new_id: Callable[[], str] | None = None, declared: Collection[str] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> ToolParser:
    """A fresh streaming parser for format `name` (one per generated choice). With `declared`
    (the request's tool names), a call naming another tool stays text (issue 26). Formats whose
    argument values are text (XML tags) read each parameter's type from `tools`."""
    parser_class: type[ToolParser] = getattr(format_module(name), FORMATS[name][1])
    if getattr(parser_class, "reads_parameter_types", False):
        return parser_class(new_id=new_id, declared=declared, parameters=parameter_types(tools))
    return parser_class(new_id=new_id, declared=declared)


__all__ = ["FORMATS", "ToolParser", "format_module", "make_tool_parser", "select_tool_parser"]
