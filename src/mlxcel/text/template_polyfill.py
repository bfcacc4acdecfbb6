"""Tool turns for chat templates that know nothing of tools (issue 16, from 17).

A template written for plain chat (SmolLM2's, the built-in chatml) reads only `role` and
`content`: an assistant turn that carries `tool_calls` with `content: null`, or a `tool` result,
breaks it or vanishes from the prompt. As llama-server does for such templates, the turns are
rewritten into text the template can render, in the generic JSON tool format the output parser
reads back (chat/tools/generic.py):

    assistant tool_calls -> content '{"tool_calls": [{"name", "arguments", "id"}], "content": ...}'
    tool result          -> a user turn '{"tool_response": {"tool", "content", "tool_call_id"}}'
    tools                -> a system text listing them, with an example call

What a template handles is found by rendering probe conversations once (`TemplateCaps.probe`):
a template that prints a probe's marker handles that kind of turn and gets it unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Render = Callable[..., str]  # (messages, tools=..., add_generation_prompt=...) -> text; raises on failure

_CALL_MARKER = "mlxcel_probe_call_7f3a"
_ARGUMENT_MARKER = "mlxcel_probe_argument_7f3a"
_RESULT_MARKER = "mlxcel_probe_result_7f3a"
_TOOL_MARKER = "mlxcel_probe_tool_7f3a"
_PROBE_CALL = {"id": "call_probe_1", "type": "function",
               "function": {"name": _CALL_MARKER, "arguments": {"argument": _ARGUMENT_MARKER}}}
TOOLS_PREAMBLE = "You can call any of the following tools to satisfy the user's requests: "
EXAMPLE_CALL = {"tool_calls": [{"name": "tool_name", "arguments": {"arg1": "some_value"}, "id": "call_1"}]}


@dataclass(frozen=True, slots=True)
class TemplateCaps:
    """Which tool turns a template renders itself."""

    supports_tools: bool = True
    supports_tool_calls: bool = True
    supports_tool_responses: bool = True
    needs_string_content: bool = False  # `content` must be a string, never missing

    @classmethod
    def probe(cls, render: Render) -> TemplateCaps:
        user = {"role": "user", "content": "Hi"}
        needs_string = (_prints(render, [user, {"role": "assistant", "content": ""}], "")
                        and not _prints(render, [user, {"role": "assistant"}], ""))
        content = {"content": ""} if needs_string else {}
        call_turn = {"role": "assistant", "tool_calls": [_PROBE_CALL], **content}
        result = {"role": "tool", "tool_call_id": "call_probe_1", "name": _CALL_MARKER, "content": _RESULT_MARKER}
        tool = {"type": "function", "function": {"name": _TOOL_MARKER, "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
        return cls(
            supports_tools=_prints(render, [user], _TOOL_MARKER, tools=[tool]),
            supports_tool_calls=_prints(render, [user, call_turn], _ARGUMENT_MARKER),
            supports_tool_responses=_prints(render, [user, {**call_turn, "content": ""}, result], _RESULT_MARKER),
            needs_string_content=needs_string,
        )

    @property
    def is_complete(self) -> bool:
        return self.supports_tools and self.supports_tool_calls and self.supports_tool_responses


def _prints(render: Render, messages: list[dict[str, Any]], marker: str, **kwargs: Any) -> bool:
    try:
        return marker in render(messages, add_generation_prompt=False, **kwargs)
    except Exception:  # noqa: BLE001 - a template that fails on the probe does not handle it
        return False


def polyfill_messages(caps: TemplateCaps, messages: list[dict[str, Any]],
                      tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """`messages` (template form, None values dropped) rewritten for what the template lacks."""
    names = _call_names(messages)
    out = []
    for message in messages:
        if not caps.supports_tool_calls and message.get("role") == "assistant" and message.get("tool_calls"):
            message = _calls_as_text(message)
        elif not caps.supports_tool_responses and message.get("role") == "tool":
            message = _result_as_text(message, names)
        if caps.needs_string_content and message.get("role") == "assistant" and message.get("content") is None:
            # only an assistant turn may come without content (its tool calls); a user's is still a 400
            message = {**message, "content": ""}
        out.append(message)
    if tools and not caps.supports_tools:
        out = _with_tools_listed(out, tools)
    return out


def _call_names(messages: list[dict[str, Any]]) -> dict[str, str]:
    """tool_call_id -> function name, so a result can say which tool answered."""
    names = {}
    for message in messages:
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(function, Mapping) and isinstance(call.get("id"), str):
                names[call["id"]] = str(function.get("name", ""))
    return names


def _calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    calls = []
    for call in message["tool_calls"]:
        function = call.get("function", call) if isinstance(call, Mapping) else {}
        entry: dict[str, Any] = {"name": function.get("name"), "arguments": _arguments(function.get("arguments"))}
        if isinstance(call, Mapping) and call.get("id"):
            entry["id"] = call["id"]
        calls.append(entry)
    reply: dict[str, Any] = {"tool_calls": calls}
    if message.get("content"):
        reply["content"] = message["content"]
    rest = {k: v for k, v in message.items() if k not in ("tool_calls", "content")}
    return {**rest, "content": json.dumps(reply, ensure_ascii=False, indent=2)}


def _arguments(value: Any) -> Any:
    # OpenAI sends arguments as a JSON string; show the model the object it would write.
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _result_as_text(message: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    call_id = message.get("tool_call_id")
    response: dict[str, Any] = {"tool": message.get("name") or names.get(str(call_id), ""),
                                "content": message.get("content", "")}
    if call_id:
        response["tool_call_id"] = call_id
    return {"role": "user", "content": json.dumps({"tool_response": response}, ensure_ascii=False, indent=2)}


def _with_tools_listed(messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    text = (TOOLS_PREAMBLE + json.dumps(list(tools), ensure_ascii=False, indent=2)
            + "\n\nExample tool call syntax:\n\n" + json.dumps(EXAMPLE_CALL, indent=2) + "\n\n")
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
