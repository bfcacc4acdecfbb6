"""Issue 26 point 1 (V) through the real server: under `tool_choice: auto` a tool call names only a
declared tool, on chat completions, Responses and Anthropic Messages, streamed and not.

The scripted model (scripted_model.py) here calls `get_sunny_city`, which no request declares:
after `<tool_call>` it writes `{"name": "get_` (which fits a declared name) and then
`sunny_city", "arguments": ` (which does not). The call grammar that waits for `<tool_call>` masks
that token; the greedy pick among the remaining equal logits takes the lowest id, and the tool's
schema leaves one path, so the reply becomes get_weather(city=Paris). Where the grammar cannot
apply, the parser returns the undeclared call as text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from mlxcel.config import EngineConfig
from mlxcel.serving.chat_model import start_served_model
from mlxcel.serving.served_model import RuntimeOptions, ServedModel
from mlxcel.server.lifecycle import ServerThread
from tests.server.scripted_model import write_scripted_model

pytestmark = pytest.mark.slow

UNDECLARED_CALL = ['{"name": "get_', 'sunny_city", "arguments": ', '{"city": ', '"Paris"', "}}"]
PARAMETERS = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"],
              "additionalProperties": False}
PING = {"type": "object", "properties": {}, "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}},
              {"type": "function", "function": {"name": "ping", "parameters": PING}}]
RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
                   for t in CHAT_TOOLS]
CLAUDE_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in CHAT_TOOLS]
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
EXPECTED = ("get_weather", {"city": "Paris"})


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedModel]:
    from mlxcel.loading import resolve_model

    folder = write_scripted_model(tmp_path_factory.mktemp("undeclared") / "model", call=UNDECLARED_CALL)
    model = start_served_model(resolve_model(str(folder)), RuntimeOptions(warmup=False, quantize="off"),
                               EngineConfig(max_num_seqs=2, ctx_size=4096))
    yield model
    model.close(30)


@pytest.fixture(scope="module")
def server_t(scripted: ServedModel, start_server: Callable[..., ServerThread]) -> ServerThread:
    return start_server(scripted)


@pytest.fixture()
def sdk(server_t: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server_t.address + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture()
def claude(server_t: ServerThread) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server_t.address, api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def test_issue26_v_the_script_calls_an_undeclared_tool(server_t: ServerThread) -> None:
    """The fixture itself: without tools the reply is the scripted call to get_sunny_city."""
    body = {"messages": QUESTION, "temperature": 0, "max_tokens": 60}
    reply = httpx.post(server_t.address + "/v1/chat/completions", json=body, timeout=60).json()
    assert '"name": "get_sunny_city"' in reply["choices"][0]["message"]["content"]


@pytest.mark.parametrize("stream", [False, True])
def test_issue26_v_chat_completions_auto_calls_only_declared_tools(sdk: openai.OpenAI, stream: bool) -> None:
    fields: dict[str, Any] = {"model": "m", "messages": QUESTION, "tools": CHAT_TOOLS, "tool_choice": "auto",
                              "temperature": 0, "max_tokens": 80}
    if stream:
        with sdk.chat.completions.stream(**fields) as events:
            completion = events.get_final_completion()
    else:
        completion = sdk.chat.completions.create(**fields)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [EXPECTED]


@pytest.mark.parametrize("stream", [False, True])
def test_issue26_v_responses_auto_calls_only_declared_tools(sdk: openai.OpenAI, stream: bool) -> None:
    fields: dict[str, Any] = {"model": "m", "input": "Weather in Paris?", "tools": RESPONSES_TOOLS,
                              "tool_choice": "auto", "temperature": 0, "max_output_tokens": 80, "store": False}
    if stream:
        events = list(sdk.responses.create(**fields, stream=True))
        assert events[-1].type == "response.completed"
        response = events[-1].response
    else:
        response = sdk.responses.create(**fields)
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [EXPECTED]
    assert not [item for item in response.output if item.type == "message"]


@pytest.mark.parametrize("stream", [False, True])
def test_issue26_v_anthropic_messages_auto_calls_only_declared_tools(claude: anthropic.Anthropic, stream: bool) -> None:
    fields: dict[str, Any] = {"model": "claude-x", "max_tokens": 80, "messages": QUESTION, "tools": CLAUDE_TOOLS,
                              "tool_choice": {"type": "auto"},
                              "extra_body": {"temperature": 0}}  # this SDK has no sampling arguments
    if stream:
        with claude.messages.stream(**fields) as events:
            message = events.get_final_message()
    else:
        message = claude.messages.create(**fields)
    assert message.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == [EXPECTED]


def test_issue26_v_an_uncompilable_schema_leaves_the_undeclared_call_as_text(sdk: openai.OpenAI) -> None:
    """No grammar (llguidance cannot compile the schema): the parser keeps the undeclared call as text."""
    weird = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}, "required": ["a"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weird}}]
    completion = sdk.chat.completions.create(model="m", messages=QUESTION, tools=tools, temperature=0, max_tokens=80)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert '"name": "get_sunny_city"' in choice.message.content


# ---- the real default model (SmolLM2, generic JSON tool format) ----

AGENT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
]
# The OpenAI Agents SDK's second request: the tool's result is in, tool_choice auto.
AGENT_TURNS = [
    {"role": "system", "content": "You are a helpful agent. Use the tools when needed."},
    {"role": "user", "content": "What's the weather in the sunniest city you know, and what time is it there?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_issue26_v_default_model_never_calls_an_undeclared_tool(server: ServerThread, stream: bool) -> None:
    declared = {t["function"]["name"] for t in AGENT_TOOLS}
    with openai.OpenAI(base_url=server.address + "/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        for seed in range(8 if not stream else 4):
            fields: dict[str, Any] = {"model": "m", "messages": AGENT_TURNS, "tools": AGENT_TOOLS,
                                      "tool_choice": "auto", "temperature": 1.0, "seed": seed, "max_tokens": 40}
            if stream:
                deltas = [c for chunk in sdk.chat.completions.create(**fields, stream=True) if chunk.choices
                          for c in chunk.choices[0].delta.tool_calls or ()]
                names = [c.function.name for c in deltas if c.function and c.function.name]
            else:
                choice = sdk.chat.completions.create(**fields).choices[0]
                message = choice.message
                names = [call.function.name for call in message.tool_calls or ()]
                # a call cut by max_tokens comes back as written, finish_reason "length" (issue 46); a finished
                # one's arguments are a JSON object
                if choice.finish_reason != "length":
                    assert all(isinstance(json.loads(c.function.arguments), dict) for c in message.tool_calls or ())
            assert set(names) <= declared, (seed, names)
