"""Every Responses tool type an agent client sends (issue 26 point 2), through the real server on the
default model: a request body shaped as Codex's first one (codex-rs/codex-api `ResponsesApiRequest`
with the tools codex-rs/tools serializes: function, custom with a Lark grammar, namespace, hosted
web_search / image_generation / tool_search), its follow-up turn (custom and namespaced calls,
their outputs, reasoning carried as encrypted_content), a forced custom tool whose regex format
constrains the call, and a forced hosted tool refused with a 400 naming it.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from mlxcel.api.responses.items import seal_reasoning
from mlxcel.server.lifecycle import ServerThread

pytestmark = pytest.mark.slow
EVENT = TypeAdapter(ResponseStreamEvent)
APPLY_PATCH_LARK = 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\nend_patch: "*** End Patch" LF?\n' \
                   'hunk: "*** Add File: " /(.+)/ LF\n%import common.LF\n'
CODEX_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "exec_command", "description": "Runs a command in a PTY.", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}, "workdir": {"type": "string"}},
                    "required": ["cmd"], "additionalProperties": False}},
    {"type": "custom", "name": "apply_patch", "description": "Use the `apply_patch` tool to edit files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_LARK}},
    {"type": "namespace", "name": "multi_agent_v1", "description": "Tools in the multi_agent_v1 namespace.",
     "tools": [{"type": "function", "name": "spawn_agent", "description": "Spawn a sub-agent.", "strict": False,
                "parameters": {"type": "object", "properties": {"message": {"type": "string"}},
                               "required": ["message"]}}]},
    {"type": "web_search", "external_web_access": False},
    {"type": "image_generation", "output_format": "png"},
    {"type": "tool_search", "execution": "sync", "description": "Search app tools",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}},
]


def codex_first_request(**overrides: Any) -> dict[str, Any]:
    """The fields codex-rs serializes for a turn (ResponsesApiRequest), with its tool list."""
    return {
        "model": "gpt-5.1-codex", "instructions": "You are Codex, a coding agent.",
        "input": [{"type": "message", "role": "developer",
                   "content": [{"type": "input_text", "text": "<permissions instructions>workspace-write"}]},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hi."}]}],
        "tools": CODEX_TOOLS, "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"}, "store": False, "stream": True,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": str(uuid.uuid4()),
        "text": {"verbosity": "low"}, "client_metadata": {"originator": "codex_cli_rs"}, "service_tier": "default",
        "max_output_tokens": 8, "temperature": 0, **overrides,
    }


def stream_events(client: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The data of every SSE event, each checked against the openai SDK's event types."""
    events = []
    with client.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200, response.read().decode()
        for line in response.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                # The tools echo is as sent: Codex's tool_search shape is newer than this SDK's type.
                EVENT.validate_python({**event, "response": {**event["response"], "tools": []}}
                                      if "response" in event else event)
                events.append(event)
    return events


@pytest.fixture()
def sdk(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.address + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def test_issue26_codex_first_request_streams_a_valid_response(client: httpx.Client,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="mlxcel.api.responses"):
        events = stream_events(client, codex_first_request())
        stream_events(client, codex_first_request())
    types = [event["type"] for event in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] in ("response.completed",
                                                                                       "response.incomplete")
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["output"] and final["tools"] == CODEX_TOOLS  # echoed as sent
    hosted = [r.getMessage() for r in caplog.records if "hosted tools" in r.getMessage()]
    assert len(hosted) <= 1  # named once per process (an earlier test may have named them already)


def test_issue26_codex_follow_up_turn_with_custom_namespaced_calls_and_sealed_reasoning(client: httpx.Client) -> None:
    turn = codex_first_request(stream=False)
    turn["input"] = [*turn["input"],
                     {"type": "reasoning", "summary": [], "encrypted_content": seal_reasoning("I will patch.")},
                     {"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch",
                      "input": "*** Begin Patch\n*** Add File: a.txt\n*** End Patch"},
                     {"type": "custom_tool_call_output", "call_id": "call_1", "output": "Done!"},
                     {"type": "function_call", "call_id": "call_2", "name": "spawn_agent",
                      "namespace": "multi_agent_v1", "arguments": '{"message": "go"}'},
                     {"type": "function_call_output", "call_id": "call_2", "output": "agent started"},
                     {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB-from-another-server"}]
    reply = client.post("/v1/responses", json=turn)
    assert reply.status_code == 200, reply.text
    assert reply.json()["status"] in ("completed", "incomplete")
    # SmolLM2's template renders no reasoning, so the calls are what the prompt shows: the custom
    # call's input and the namespaced name (the reasoning fold is tested in tests/api/responses).
    counted = client.post("/v1/responses/input_tokens", json=turn).json()["input_tokens"]
    without_calls = client.post("/v1/responses/input_tokens", json={**turn, "input": turn["input"][:2]}).json()
    assert counted > without_calls["input_tokens"] + 20


def test_issue26_forced_custom_tool_follows_its_regex(sdk: openai.OpenAI) -> None:
    pick = {"type": "custom", "name": "pick_colour", "description": "Pick a colour",
            "format": {"type": "grammar", "syntax": "regex", "definition": "(red|green|blue)"}}
    response = sdk.responses.create(model="m", input="Pick a colour.", tools=[pick],  # type: ignore[list-item]
                                    tool_choice={"type": "custom", "name": "pick_colour"}, temperature=0,
                                    max_output_tokens=40, store=False)
    [call] = [item for item in response.output if item.type == "custom_tool_call"]
    assert call.name == "pick_colour" and re.fullmatch("(red|green|blue)", call.input), call.input


def test_issue26_forced_namespaced_call_is_reported_with_its_namespace(client: httpx.Client) -> None:
    body = codex_first_request(stream=False, max_output_tokens=40,
                               tool_choice={"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"})
    reply = client.post("/v1/responses", json=body).json()
    [call] = [item for item in reply["output"] if item["type"] == "function_call"]
    assert (call["name"], call["namespace"]) == ("spawn_agent", "multi_agent_v1")
    assert isinstance(json.loads(call["arguments"])["message"], str)


@pytest.mark.parametrize("kind", ["web_search", "web_search_preview", "file_search", "code_interpreter",
                                  "image_generation", "computer_use_preview", "mcp", "local_shell"])
def test_issue26_forcing_a_hosted_tool_is_400_naming_it(client: httpx.Client, kind: str) -> None:
    reply = client.post("/v1/responses", json=codex_first_request(stream=False, tool_choice={"type": kind}))
    assert reply.status_code == 400 and f"'{kind}' is a hosted tool" in reply.json()["error"]["message"]
