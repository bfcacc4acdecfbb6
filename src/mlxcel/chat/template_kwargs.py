"""Chat-template keyword arguments (spec S): server defaults, per-request overrides, and the
message rewrites they drive.

Sources, lowest first, merged per key (a request key replaces only that key):
  LLAMA_ARG_CHAT_TEMPLATE_KWARGS < --chat-template-kwargs        (server defaults, JSON objects)
  < the request's kwargs (`ChatOptions.template_kwargs`: its adapter merged the request's own
    layers, see api/chat_options.py)
`enable_thinking=true` joins the server defaults when the tokenizer has reasoning markers.
`reasoning_effort` becomes a kwarg only when the template reads it and the request set no
explicit `reasoning_effort` kwarg.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from mlxcel.chat.reasoning import ThinkTokens, strip_think_blocks

log = logging.getLogger(__name__)

# Template variables the request controls through its own fields; a kwarg may not set them.
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"})


class TemplateKwargsError(ValueError):
    """Invalid template kwargs: a startup error for the flag/variable, a 400 for a request."""


class Template(Protocol):
    def mentions(self, name: str) -> bool: ...


def parse_kwargs_json(text: str, source: str) -> dict[str, Any]:
    """A JSON object of kwargs from `source` (a flag or variable name, for the message)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise TemplateKwargsError(f"{source} is not valid JSON ({exc}): {text!r}") from None
    return _check_object(value, source)


def check_request_kwargs(value: Any, source: str) -> dict[str, Any]:
    """`value` as template kwargs from `source` (named in the message); raises TemplateKwargsError
    unless it is an object that sets no reserved name."""
    return _check_object(value, source)


def check_flag(value: Any, name: str) -> bool:
    """A kwarg given as its own field (preserve_thinking) must be a boolean; TemplateKwargsError if not."""
    if not isinstance(value, bool):
        raise TemplateKwargsError(f"{name} must be true or false, not {value!r}")
    return value


def _check_object(value: Any, source: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise TemplateKwargsError(f"{source} must be a JSON object, not {type(value).__name__}")
    reserved = sorted(RESERVED & set(value))
    if reserved:
        raise TemplateKwargsError(f"{source} may not set {', '.join(reserved)} (use the request's own fields)")
    return dict(value)


def server_template_kwargs(cli_value: str | None, env_value: str | None = None) -> dict[str, Any]:
    """The server-wide defaults: LLAMA_ARG_CHAT_TEMPLATE_KWARGS under --chat-template-kwargs.
    Raises TemplateKwargsError (refuse startup) when either is not a JSON object."""
    merged: dict[str, Any] = {}
    if env_value:
        merged.update(parse_kwargs_json(env_value, "LLAMA_ARG_CHAT_TEMPLATE_KWARGS"))
    if cli_value:
        merged.update(parse_kwargs_json(cli_value, "--chat-template-kwargs"))
    return merged


def with_thinking_default(defaults: Mapping[str, Any], think: ThinkTokens | None) -> dict[str, Any]:
    """`defaults` plus `enable_thinking=true` when the model has reasoning markers (logged once,
    at startup, with the marker pair); an explicit server setting is kept."""
    kwargs = dict(defaults)
    if think is None or "enable_thinking" in kwargs:
        return kwargs
    kwargs["enable_thinking"] = True
    log.info(
        "Tokenizer recognizes a think marker pair; defaulting chat_template kwarg `enable_thinking=true` "
        'think_start=Some("%s") think_end=Some("%s") think_start_tokens_len=%d think_end_tokens_len=%d',
        think.start, think.end, len(think.start_ids), len(think.end_ids),
    )
    return kwargs


def effective_template_kwargs(
    server_defaults: Mapping[str, Any], explicit: Mapping[str, Any], effort: str | None, template: Template | None
) -> dict[str, Any]:
    """What the template renders with: server defaults, then the request's kwargs (`explicit`),
    then `effort` as `reasoning_effort` when the template reads it."""
    kwargs = {**server_defaults, **explicit}
    reads_effort = template is not None and template.mentions("reasoning_effort")
    if effort is not None and "reasoning_effort" not in explicit and reads_effort:
        kwargs["reasoning_effort"] = effort  # passed as given, never translated
    return kwargs


def preserves_thinking(kwargs: Mapping[str, Any]) -> bool:
    """preserve_thinking defaults to false: old reasoning is stripped (Qwen's rolling checkpoint)."""
    return kwargs.get("preserve_thinking") is True


def strip_stale_thinking(
    messages: Sequence[Mapping[str, Any]], think: ThinkTokens | None
) -> list[dict[str, Any]]:
    """Messages with `<think>` blocks removed from the content of assistant turns before the
    last non-tool user turn (apply when preserve_thinking is not true). Reasoning *fields*
    are left for the template, which decides how to render them."""
    markers = (think.start, think.end) if think is not None else ("<think>", "</think>")
    last_query = _last_query_index(messages)
    out = []
    for i, message in enumerate(messages):
        copy = dict(message)
        if i < last_query and copy.get("role") == "assistant":
            copy["content"] = _strip_content(copy.get("content"), markers)
        out.append(copy)
    return out


def _last_query_index(messages: Sequence[Mapping[str, Any]]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        message = messages[i]
        if message.get("role") == "user" and not _is_tool_response(message.get("content")):
            return i
    return -1


def _is_tool_response(content: Any) -> bool:
    # Qwen templates wrap tool results sent as user turns in <tool_response> tags.
    return isinstance(content, str) and content.startswith("<tool_response>") and content.endswith("</tool_response>")


def _strip_content(content: Any, markers: tuple[str, str]) -> Any:
    if isinstance(content, str):
        return strip_think_blocks(content, markers)
    if isinstance(content, list):
        return [_strip_part(part, markers) for part in content]
    return content


def _strip_part(part: Any, markers: tuple[str, str]) -> Any:
    if isinstance(part, Mapping) and isinstance(part.get("text"), str):
        return {**part, "text": strip_think_blocks(part["text"], markers)}
    return part
