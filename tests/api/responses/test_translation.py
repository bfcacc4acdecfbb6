"""Responses input translation (F2) as golden JSON: request items -> stored items -> chat messages,
and request fields -> the engine's sampling parameters. Body errors are 400s naming the item (D1).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

from mlxcel.api.errors import ApiError
from mlxcel.api.responses.create import generation_params, parse_create_request
from mlxcel.api.responses.prompt import chat_options
from mlxcel.api.responses.items import (
    COMPACTION_HEADING, conversation_turns, media_refs, seal_reasoning, stored_items, to_chat_messages,
    unseal_reasoning,
)  # fmt: skip
from mlxcel.api.responses.prompt import drop_first_turn
from mlxcel.api.responses.schemas import parse_input_items
from mlxcel.api.responses.tools import CallTarget, parse_tools, template_tool_choice
from mlxcel.media import MediaKind, MediaRef
from mlxcel.types import Priority, SamplingParams


def counter_ids() -> Callable[[str], str]:
    numbers = itertools.count(1)
    return lambda prefix: f"{prefix}_{next(numbers)}"


def stored(value: Any) -> list[dict[str, Any]]:
    return stored_items(parse_input_items(value), counter_ids())


AGENT_TURNS = [
    {"role": "developer", "content": "Use tools."},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"},
                                                     {"type": "input_text", "text": "And Bergen?"}]},
    {"type": "reasoning", "id": "rs_given", "summary": [{"type": "summary_text", "text": "Need the tool."}]},
    {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{\"city\":\"Oslo\"}"},
    {"type": "function_call", "call_id": "call_2", "name": "weather", "arguments": "{\"city\":\"Bergen\"}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "3 C"},
    {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "5 C"}]},
    {"role": "assistant", "content": "Oslo 3 C, Bergen 5 C."},
]


def test_f2_string_input_is_one_user_message() -> None:
    assert stored("Hi") == [{"type": "message", "id": "msg_1", "role": "user", "status": "completed",
                             "content": [{"type": "input_text", "text": "Hi"}]}]
    assert to_chat_messages("Be brief.", stored("Hi")) == [{"role": "system", "content": "Be brief."},
                                                           {"role": "user", "content": "Hi"}]


def test_f2_stored_items_golden() -> None:
    items = stored(AGENT_TURNS)
    assert items == [
        {"type": "message", "id": "msg_1", "role": "developer", "status": "completed",
         "content": [{"type": "input_text", "text": "Use tools."}]},
        {"type": "message", "id": "msg_2", "role": "user", "status": "completed",
         "content": [{"type": "input_text", "text": "Weather in Oslo?"},
                     {"type": "input_text", "text": "And Bergen?"}]},
        {"type": "reasoning", "id": "rs_given", "summary": [{"type": "summary_text", "text": "Need the tool."}]},
        {"type": "function_call", "id": "fc_3", "call_id": "call_1", "name": "weather",
         "arguments": "{\"city\":\"Oslo\"}", "status": "completed"},
        {"type": "function_call", "id": "fc_4", "call_id": "call_2", "name": "weather",
         "arguments": "{\"city\":\"Bergen\"}", "status": "completed"},
        {"type": "function_call_output", "id": "fco_5", "call_id": "call_1", "output": "3 C", "status": "completed"},
        {"type": "function_call_output", "id": "fco_6", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "5 C"}], "status": "completed"},
        {"type": "message", "id": "msg_7", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Oslo 3 C, Bergen 5 C.", "annotations": []}]},
    ]


def test_f2_chat_messages_golden() -> None:
    """developer -> system; reasoning joins the assistant turn; both calls on one assistant message."""
    assert to_chat_messages(None, stored(AGENT_TURNS)) == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Oslo?\nAnd Bergen?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}},
            {"id": "call_2", "type": "function",
             "function": {"name": "weather", "arguments": "{\"city\":\"Bergen\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 C", "name": "weather"},
        {"role": "tool", "tool_call_id": "call_2", "content": "5 C", "name": "weather"},
        {"role": "assistant", "content": "Oslo 3 C, Bergen 5 C."},
    ]


def test_f2_compaction_joins_the_leading_system_message() -> None:
    items = stored([{"type": "compaction", "encrypted_content": "User is Ada."}, {"role": "user", "content": "Hi"}])
    assert items[0] == {"type": "compaction", "id": "cmp_1", "encrypted_content": "User is Ada."}
    assert to_chat_messages("Be kind.", items) == [
        {"role": "system", "content": f"Be kind.\n\n{COMPACTION_HEADING}\nUser is Ada."},
        {"role": "user", "content": "Hi"}]


def test_f2_turns_split_at_the_last_user_message() -> None:
    items = stored([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}])
    older, last = conversation_turns(items)
    assert [i["id"] for i in older] == ["msg_1", "msg_2"] and [i["id"] for i in last] == ["msg_3", "msg_4"]
    assert [i["id"] for i in drop_first_turn(items) or []] == ["msg_3", "msg_4"]
    assert drop_first_turn(last) is None


def test_f2_function_tools_in_template_shape() -> None:
    req = parse_create_request({"input": "x", "tools": [
        {"type": "function", "name": "weather", "description": "Get weather", "strict": True,
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]})
    assert parse_tools(req.tools).template == [{"type": "function", "function": {
        "name": "weather", "description": "Get weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


# ---- issue 26: every Responses tool type (the shapes codex-rs/tools serializes) ----

CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Run a command", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
    {"type": "custom", "name": "apply_patch", "description": "Edit files",
     "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/'}},
    {"type": "custom", "name": "pick", "description": "Pick one", "format": {"type": "grammar", "syntax": "regex",
                                                                            "definition": "(red|blue)"}},
    {"type": "namespace", "name": "multi_agent_v1", "description": "Agents", "tools": [
        {"type": "function", "name": "spawn_agent", "description": "Spawn", "strict": False,
         "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}]},
    {"type": "namespace", "name": "mcp__demo__", "description": "Demo", "tools": [
        {"type": "function", "name": "lookup", "strict": False, "parameters": {"type": "object", "properties": {}}}]},
    {"type": "web_search", "external_web_access": True},
    {"type": "image_generation", "output_format": "png"},
    {"type": "tool_search", "execution": "sync", "description": "Search tools", "parameters": {"type": "object"}},
    {"type": "local_shell"},
]


def test_issue26_every_tool_type_is_read() -> None:
    tools = parse_tools(parse_create_request({"input": "x", "tools": CODEX_TOOLS}).tools)
    assert [t["function"]["name"] for t in tools.template] == [
        "exec_command", "apply_patch", "pick", "multi_agent_v1__spawn_agent", "mcp__demo__lookup"]
    assert tools.hosted == ("web_search", "image_generation", "tool_search", "local_shell")
    assert tools.target("apply_patch") == CallTarget("custom", "apply_patch")
    assert tools.target("multi_agent_v1__spawn_agent") == CallTarget("function", "spawn_agent", "multi_agent_v1")
    assert tools.target("mcp__demo__lookup") == CallTarget("function", "lookup", "mcp__demo__")
    pick = tools.template[2]["function"]["parameters"]
    assert pick["properties"]["input"]["pattern"] == "^(?:(red|blue))$" and pick["required"] == ["input"]
    assert "*** Begin Patch" in tools.template[1]["function"]["description"]  # a Lark grammar: described


@pytest.mark.parametrize(("tool", "needle"), [
    ({"type": "teleport"}, "tools.0.type: 'teleport' is not a tool type"),
    ({"type": "custom"}, "tools.0.name"),
    ({"type": "namespace", "name": "n", "tools": [{"type": "function"}]}, "tools.0.tools.0"),
])
def test_issue26_bad_tools_are_400_naming_them(tool: dict, needle: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ApiError) as raised:
        parse_create_request({"input": "x", "tools": [tool]})
    assert raised.value.status == 400 and needle in raised.value.message


def test_issue26_forcing_a_hosted_tool_is_400_and_custom_choices_name_their_function() -> None:
    tools = parse_tools(CODEX_TOOLS)
    with pytest.raises(ApiError) as raised:
        template_tool_choice({"type": "web_search_preview"}, tools)
    assert raised.value.status == 400 and "'web_search_preview' is a hosted tool" in raised.value.message
    assert template_tool_choice({"type": "custom", "name": "apply_patch"}, tools) == {"type": "function",
                                                                                     "name": "apply_patch"}
    assert template_tool_choice("auto", tools) == "auto"


def test_issue26_custom_and_namespaced_calls_fold_back_into_the_template_names() -> None:
    items = stored_items(parse_input_items([
        {"role": "user", "content": "go"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "function_call", "call_id": "c2", "name": "spawn_agent", "namespace": "multi_agent_v1",
         "arguments": "{}"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "done"},
        {"type": "function_call_output", "call_id": "c2", "output": "spawned"}]))
    messages = to_chat_messages(None, items)
    calls = messages[1]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["apply_patch", "multi_agent_v1__spawn_agent"]
    assert calls[0]["function"]["arguments"] == '{"input": "*** Begin Patch"}'
    assert messages[2:] == [{"role": "tool", "tool_call_id": "c1", "content": "done", "name": "apply_patch"},
                            {"role": "tool", "tool_call_id": "c2", "content": "spawned",
                             "name": "multi_agent_v1__spawn_agent"}]


def test_issue26_sealed_reasoning_round_trips_and_foreign_values_are_skipped() -> None:
    sealed = seal_reasoning("Let me think. 🦙")
    assert unseal_reasoning(sealed) == "Let me think. 🦙"
    assert unseal_reasoning(sealed[:-1] + ("0" if sealed[-1] != "0" else "1")) is None  # damaged: tag differs
    assert unseal_reasoning("gAAAAABo-openai-encrypted") is None
    items = stored_items(parse_input_items([
        {"role": "user", "content": "q"},
        {"type": "reasoning", "summary": [], "encrypted_content": sealed},
        {"role": "assistant", "content": "a"},
        {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAABo-openai-encrypted"},
        {"role": "assistant", "content": "b"}]))
    messages = to_chat_messages(None, items)
    assert messages[1] == {"role": "assistant", "content": "a", "reasoning_content": "Let me think. 🦙"}
    assert messages[2] == {"role": "assistant", "content": "b"}  # nothing readable: no reasoning


def test_f2_media_parts_become_refs() -> None:
    items = parse_input_items([{"role": "user", "content": [
        {"type": "input_text", "text": "see"},
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}])
    assert media_refs(items) == [MediaRef(MediaKind.IMAGE, "data:image/png;base64,AAAA"),
                                 MediaRef(MediaKind.AUDIO, "data:audio/wav;base64,AAAA")]


@pytest.mark.parametrize(("value", "message"), [
    ([{"type": 5, "id": "x"}], "input.0.type: must be a string"),
    ([{"type": "item_reference", "id": "msg_1"}], "input.0: item_reference is not supported"),
    (["hi"], "input.0: each input item must be an object"),
    ([{"role": "user", "content": "ok"}, {"role": "robot", "content": "x"}], "input.1.role: Input should be"),
    ([{"role": "user", "content": [{"type": "input_text", "text": 5}]}], "input.0.content.list[tagged-union"),
    ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}], "input.0.arguments"),
])
def test_d1_bad_items_are_400s_naming_the_item(value: Any, message: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_input_items(value)
    assert caught.value.status == 400 and caught.value.type == "invalid_request_error"
    assert message in caught.value.message


def test_issue46_history_only_items_are_read_not_refused(caplog: pytest.LogCaptureFixture) -> None:
    """Hosted tools' items as history: a call with a call_id and its output pair up as a call and a tool message;
    a web search is the assistant's text; an item with nothing to show is left out and logged once."""
    items = stored([
        {"role": "user", "content": "list files"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search", "query": "q"}},
        {"type": "local_shell_call", "id": "lsc_1", "call_id": "c1", "status": "completed",
         "action": {"type": "exec", "command": ["ls"]}},
        {"type": "local_shell_call_output", "id": "lso_1", "call_id": "c1", "output": "a.txt"},
        {"type": "mcp_list_tools", "server_label": "x", "tools": []},
        {"type": "mcp_list_tools", "server_label": "y", "tools": []},
    ])
    assert [item["type"] for item in items][1:] == ["web_search_call", "local_shell_call", "local_shell_call_output",
                                                    "mcp_list_tools", "mcp_list_tools"]
    assert items[1]["action"] == {"type": "search", "query": "q"} and items[4]["id"]  # kept as sent, with an id
    with caplog.at_level("WARNING"):
        messages = to_chat_messages(None, items)
        to_chat_messages(None, items)
    assert messages == [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": 'web_search_call: {"action": {"type": "search", "query": "q"}}',
         "tool_calls": [{"id": "c1", "type": "function", "function": {
             "name": "local_shell", "arguments": '{"action": {"type": "exec", "command": ["ls"]}}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt", "name": "local_shell"},
    ]
    assert sum("mcp_list_tools" in r.getMessage() for r in caplog.records) <= 1


def test_f2_image_without_url_and_files_are_refused() -> None:
    with pytest.raises(ApiError, match="input_image needs an image_url"):
        media_refs(parse_input_items([{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]))
    items = stored([{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}])
    with pytest.raises(ApiError, match=r"input.0.content.0: content of type 'input_file' is not supported"):
        to_chat_messages(None, items)


@pytest.mark.parametrize(("body", "message"), [
    ({"input": 5}, "input"),
    ({}, "input: at least one input item"),
    ({"input": []}, "input: at least one input item"),
    ({"input": "x", "max_output_tokens": "5"}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "tools": [{"type": "teleport"}]}, "tools.0.type"),  # hosted types are accepted (issue 26)
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "json_schema needs a name and a schema"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata.k"),
    ([1, 2], "must be a JSON object"),
])
def test_d1_wrong_fields_are_400(body: Any, message: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_create_request(body)
    assert caught.value.status == 400 and message in caught.value.message


class FakeContext:
    """generation_params reads nothing of the context; this stands in for it."""


def test_f2_sampling_fields_golden() -> None:
    req = parse_create_request({"input": "x", "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                                "top_logprobs": 2, "include": ["message.output_text.logprobs"],
                                "extra_body": {"top_k": 5, "seed": 3, "stop": "END", "cache_prompt": False}})
    params = generation_params(FakeContext(), req, {"x-priority": "high"})  # type: ignore[arg-type]
    sampling = chat_options(req).sampling  # the request's options carry its sampling (issue 17)
    assert sampling == SamplingParams(temperature=0.5, top_k=5, top_p=0.9, min_p=0.05, seed=3, max_tokens=7, logprobs=2)
    assert params.stop == ("END",) and params.priority is Priority.HIGH and params.cache_prompt is False
    default = chat_options(parse_create_request({"input": "x"})).sampling
    # Issue 46: no sampling fields -> llama-server's defaults (no server flags, no checkpoint values here).
    assert default == SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, max_tokens=None, logprobs=None)
