"""Every Responses tool type a client sends (issue 26, as Codex builds them in codex-rs/tools):

    function    {"type": "function", "name", "description", "parameters", "strict"}
    custom      {"type": "custom", "name", "description", "format": {"type": "text"} or
                 {"type": "grammar", "syntax": "lark" | "regex", "definition"}}: free-form input
    namespace   {"type": "namespace", "name", "description", "tools": [function | custom ...]}
    hosted      web_search, file_search, code_interpreter, image_generation, computer_use, mcp,
                local_shell, tool_search ...: run by OpenAI's servers, not here

The template sees plain functions: a custom tool is a function of one string argument `input`
(a regex format becomes that string's `pattern`, so a forced call follows it; a Lark grammar
cannot be enforced inside the call's JSON and is offered as the tool's description only), and a
namespace's members are named `<namespace>__<name>`. A call comes back as the client declared
it: a `custom_tool_call` with `input`, or a `function_call` with the member's `name` and its
`namespace`. Hosted tools are left out of the prompt and named once in the log; a tool_choice
that forces one is a 400.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, ValidationError

from mlxcel.api.errors import invalid_request
from mlxcel.api.schema import WireModel

log = logging.getLogger("mlxcel.api.responses")

HOSTED_TOOL_TYPES = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search", "code_interpreter",
    "image_generation", "computer_use", "computer_use_preview", "mcp", "local_shell", "tool_search",
})
CUSTOM_INPUT = "input"  # the one argument a custom tool's function takes
NAMESPACE_JOIN = "__"


class FunctionTool(WireModel):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomFormat(WireModel):
    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None


class CustomTool(WireModel):
    type: Literal["custom"]
    name: str = Field(min_length=1)
    description: str | None = None
    format: CustomFormat | None = None


class NamespaceTool(WireModel):
    type: Literal["namespace"]
    name: str = Field(min_length=1)
    description: str | None = None
    tools: list[FunctionTool | CustomTool] = Field(min_length=1)


@dataclass(frozen=True, slots=True)
class CallTarget:
    """What a call to one template function is, in the client's terms."""

    kind: Literal["function", "custom"]
    name: str
    namespace: str | None = None


@dataclass(slots=True)
class ToolSet:
    """A request's tools: the template's functions, what each call maps back to, the hosted ones."""

    template: list[dict[str, Any]] = field(default_factory=list)
    targets: dict[str, CallTarget] = field(default_factory=dict)  # template function name -> target
    hosted: tuple[str, ...] = ()

    def target(self, name: str) -> CallTarget:
        return self.targets.get(name, CallTarget("function", name))


def parse_tools(raw: Sequence[Any] | None) -> ToolSet:
    """The request's `tools`; raises ApiError(400) naming `tools.N` for a malformed or unknown one."""
    tools = ToolSet()
    for index, tool in enumerate(raw or ()):
        _add(tools, index, tool)
    return tools


def _add(tools: ToolSet, index: int, raw: Any) -> None:
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind in HOSTED_TOOL_TYPES:
        tools.hosted += (kind,)
        return
    models: dict[Any, type[WireModel]] = {"function": FunctionTool, "custom": CustomTool, "namespace": NamespaceTool}
    model = models.get(kind)
    if model is None:
        raise invalid_request(f"tools.{index}.type: {kind!r} is not a tool type this server knows (function, "
                              f"custom, namespace, or a hosted tool: {', '.join(sorted(HOSTED_TOOL_TYPES))})")
    try:
        tool = model.model_validate(raw)
    except ValidationError as exc:
        raise invalid_request(_errors(index, exc)) from None
    members = tool.tools if isinstance(tool, NamespaceTool) else [tool]
    namespace = tool.name if isinstance(tool, NamespaceTool) else None
    for member in members:
        assert isinstance(member, FunctionTool | CustomTool)
        name = namespaced(namespace, member.name) if namespace else member.name
        tools.template.append(_template_function(name, member))
        tools.targets[name] = CallTarget("custom" if isinstance(member, CustomTool) else "function", member.name,
                                         namespace)


def namespaced(namespace: str, name: str) -> str:
    """A namespace member's function name in the prompt (`mcp__demo__` + `x` stays `mcp__demo__x`)."""
    join = "" if namespace.endswith(NAMESPACE_JOIN) else NAMESPACE_JOIN
    return f"{namespace}{join}{name}"


def _template_function(name: str, tool: FunctionTool | CustomTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if isinstance(tool, FunctionTool):
        function |= tool.model_dump(include={"description", "parameters"}, exclude_none=True)
        return {"type": "function", "function": function}
    text: dict[str, Any] = {"type": "string", "description": "the tool's free-form input"}
    description = tool.description or ""
    fmt = tool.format
    if fmt is not None and fmt.type == "grammar" and fmt.definition:
        if fmt.syntax == "regex":
            text["pattern"] = f"^(?:{fmt.definition})$"  # the whole input; a JSON Schema pattern alone may match a part
        else:
            description += f"\n\nThe input follows this {fmt.syntax or 'lark'} grammar:\n{fmt.definition}"
    if description:
        function["description"] = description
    function["parameters"] = {"type": "object", "properties": {CUSTOM_INPUT: text}, "required": [CUSTOM_INPUT],
                              "additionalProperties": False}
    return {"type": "function", "function": function}


def _errors(index: int, exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in ('tools', index, *error['loc']))}: {error['msg']}"
                     for error in exc.errors(include_url=False))


def template_tool_choice(choice: str | Mapping[str, Any] | None, tools: ToolSet) -> str | Mapping[str, Any] | None:
    """tool_choice for the chat features: a custom or namespaced tool named by its template function;
    forcing a hosted tool is a 400 naming it."""
    if not isinstance(choice, Mapping):
        return choice
    kind = choice.get("type")
    if kind in HOSTED_TOOL_TYPES:
        raise invalid_request(f"tool_choice: {kind!r} is a hosted tool that this server cannot run; "
                              "choose auto, none, required or one of the request's functions")
    name = choice.get("name")
    if kind in ("custom", "function") and isinstance(name, str):
        namespace = choice.get("namespace")
        return {"type": "function", "name": namespaced(namespace, name) if isinstance(namespace, str) else name}
    return choice


_LOGGED_HOSTED: set[str] = set()
_LOGGED_LOCK = threading.Lock()


def log_hosted(tools: ToolSet) -> None:
    """Name each hosted tool type once per process: they are accepted and left out of the prompt."""
    with _LOGGED_LOCK:
        new = sorted(set(tools.hosted) - _LOGGED_HOSTED)
        _LOGGED_HOSTED.update(new)
    if new:
        log.info("Responses: hosted tools %s are accepted and left out of the prompt (this server cannot run "
                 "them)", ", ".join(new))


def custom_input(arguments: str) -> str:
    """A custom tool call's free-form input from its function arguments ({"input": ...})."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str):
        return value[CUSTOM_INPUT]
    return arguments


def call_arguments(item: Mapping[str, Any]) -> tuple[str, str]:
    """(template function name, arguments JSON) of a function_call or custom_tool_call input item."""
    namespace = item.get("namespace")
    name = namespaced(namespace, item["name"]) if namespace else item["name"]
    if item["type"] == "custom_tool_call":
        return name, json.dumps({CUSTOM_INPUT: item["input"]}, ensure_ascii=False)
    return name, item["arguments"]
