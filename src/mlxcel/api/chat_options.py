"""The protocol edge of the chat features: wire fields -> one typed `chat.options.ChatOptions`.

Every chat-shaped body (OpenAI chat and completions, Responses, Anthropic Messages, llama-server
/completion and /apply-template) accepts the same llama-server / vLLM / Qwen extension fields,
declared once in `api/schema.ChatFeatureFields`; each adapter validates its body (after the one
extra_body rule, `api/schema.flatten_extra_body`), reads its sampling fields into the engine's
`SamplingParams` (max_tokens once, there) and hands both with its own fields to
`build_chat_options`, which checks them with the chat features' messages (a 400) and returns the
options. Below `api/` nobody reads a request body or a protocol's field names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mlxcel.api.errors import invalid_request
from mlxcel.api.schema import ChatFeatureFields
from mlxcel.chat.budget import check_request_budget
from mlxcel.chat.grammar import GrammarError
from mlxcel.chat.loop_guard import FIELDS as LOOP_FIELDS
from mlxcel.chat.loop_guard import check_request_overrides
from mlxcel.chat.options import AUTO, ChatOptions, OutputConstraint, ToolChoice
from mlxcel.chat.plan import REQUEST_ERRORS
from mlxcel.chat.template_kwargs import check_flag, check_request_kwargs
from mlxcel.types import SamplingParams

# The reasoning budget's field names, first present (not null) wins: ours, vLLM's, Qwen's (R).
BUDGET_FIELDS = ("thinking_budget_tokens", "thinking_token_budget", "thinking_budget")
SESSION_FIELDS = ("prompt_cache_key", "user")  # the reasoning echo's session key, first set wins (Q)


def build_chat_options(fields: ChatFeatureFields, **choices: Any) -> ChatOptions:
    """`read_chat_options`, with an invalid chat-feature field as ApiError(400)."""
    try:
        return read_chat_options(fields, **choices)
    except REQUEST_ERRORS as exc:
        raise invalid_request(str(exc)) from None


def read_chat_options(
    fields: ChatFeatureFields, *, sampling: SamplingParams | None = None, output: Sequence[tuple[str, Any]] = (),
    tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: Any = None, parallel_tool_calls: bool = True,
    max_tokens: int | None = None, reasoning_effort: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None, budget: Sequence[tuple[str, Any]] | None = None,
    remembers_reasoning: bool = True, reasoning_control: bool = False,
) -> ChatOptions:
    """The options of one request from its validated `fields`, its `sampling` and the protocol's
    own fields: `output` lists its format fields as (name, format object), `tool_choice` is its
    field in any protocol's shape; `template_kwargs` / `budget` replace what `fields` gives where
    the protocol maps its own fields onto them (Anthropic's `thinking`). A route that only renders
    (a token count) gives no `sampling`, only `max_tokens`. The reasoning budget must fit in
    `max_tokens` when given (llama-server's n_predict 0, where the engine samples one token the
    reply drops), else in `sampling.max_tokens`. Raises one of chat.plan.REQUEST_ERRORS for an
    invalid field."""
    sampling = sampling or SamplingParams(max_tokens=max_tokens)
    limit = sampling.max_tokens if max_tokens is None else max_tokens
    kwargs = request_template_kwargs(fields) if template_kwargs is None else dict(template_kwargs)
    return ChatOptions(
        template_kwargs=kwargs, reasoning_effort=reasoning_effort,
        reasoning_budget=request_budget(budget_fields(fields) if budget is None else budget, limit),
        output=output_constraints(fields, output), tools=tools, tool_choice=read_tool_choice(tool_choice),
        parallel_tool_calls=parallel_tool_calls,
        loop_overrides=check_request_overrides({f: getattr(fields, f) for f in LOOP_FIELDS}),
        session=session_key(fields), cache_prompt=fields.cache_prompt,
        remembers_reasoning=remembers_reasoning, reasoning_control=reasoning_control, sampling=sampling,
    )


def request_template_kwargs(fields: ChatFeatureFields) -> dict[str, Any]:
    """The request's template kwargs: `preserve_thinking` under `chat_template_kwargs` (S)."""
    merged: dict[str, Any] = {}
    if fields.preserve_thinking is not None:
        merged["preserve_thinking"] = check_flag(fields.preserve_thinking, "preserve_thinking")
    if fields.chat_template_kwargs is not None:
        merged.update(check_request_kwargs(fields.chat_template_kwargs, "chat_template_kwargs"))
    return merged


def budget_fields(fields: ChatFeatureFields) -> list[tuple[str, Any]]:
    """The budget fields in precedence order, as (name, value)."""
    return [(name, getattr(fields, name)) for name in BUDGET_FIELDS]


def request_budget(candidates: Sequence[tuple[str, Any]], max_tokens: int | None) -> int | None:
    """The first budget given (not null), checked against max_tokens; None when none is."""
    for name, value in candidates:
        if value is not None:
            return check_request_budget(name, value, max_tokens)
    return None


def output_constraints(fields: ChatFeatureFields, formats: Sequence[tuple[str, Any]]) -> tuple[OutputConstraint, ...]:
    """The protocol's format objects, then llama-server's `json_schema` and `grammar`."""
    found = [OutputConstraint("format", value, name) for name, value in formats if value is not None]
    if fields.json_schema is not None:
        found.append(OutputConstraint("json_schema", fields.json_schema, "json_schema"))
    if fields.grammar:  # an empty grammar string is none
        found.append(OutputConstraint("gbnf", fields.grammar, "grammar"))
    return tuple(found)


def session_key(fields: ChatFeatureFields) -> str:
    """The request's session: prompt_cache_key, else user, else ""."""
    for name in SESSION_FIELDS:
        value = getattr(fields, name)
        if isinstance(value, str) and value:
            return f"{name}:{value}"
    return ""


def read_tool_choice(value: Any) -> ToolChoice:
    """`tool_choice` in any protocol's shape: "auto" / "none" / "required" / "any" (a string or
    {"type": ...}), or a named function: {"type": "function", "function": {"name"}} (chat),
    {"type": "function", "name"} (responses), {"type": "tool", "name"} (anthropic)."""
    kind = value.get("type") if isinstance(value, Mapping) else value
    if kind in ("function", "tool") and isinstance(value, Mapping):
        return ToolChoice("required", _named_function(value))
    if kind in ("required", "any"):
        return ToolChoice("required")
    return ToolChoice("none") if kind == "none" else AUTO


def _named_function(choice: Mapping[str, Any]) -> str:
    function = choice.get("function")
    name = function.get("name") if isinstance(function, Mapping) else choice.get("name")
    if not isinstance(name, str) or not name:
        raise GrammarError("tool_choice of type function must name the function")
    return name


__all__ = ["BUDGET_FIELDS", "budget_fields", "build_chat_options", "output_constraints", "read_chat_options",
           "read_tool_choice", "request_budget", "request_template_kwargs", "session_key"]
