"""Issue 26 leftover through the real server: a small model that writes its tool call as a Markdown
```json block `{"name": ..., "arguments": {...}}` without `<tool_call>` tags (MODELS.md: Qwen2.5-Coder
under Claude Code) gets a real tool call when the name is a declared tool, and text otherwise, on chat
completions (streamed and not), Responses and Anthropic Messages.

The scripted model (scripted_model.py, Hermes template) writes, after its reasoning,
`I will check.\\n```json\\n` {"name": "get_weather", "arguments": {"city": "Paris"}} `\\n```` and ends.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import openai
import pytest

from mlxcel.config import EngineConfig
from mlxcel.serving.chat_model import start_served_model
from mlxcel.serving.served_model import RuntimeOptions, ServedModel
from mlxcel.server.lifecycle import ServerThread
from tests.server.scripted_model import CALL, WEATHER_TOOL, write_scripted_model

pytestmark = pytest.mark.slow

OPENER, CLOSER = "I will check.\n```json\n", "\n```"
BLOCK = "```json\n" + "".join(CALL) + "\n```"
PING_TOOL = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def fenced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedModel]:
    from mlxcel.loading import resolve_model

    folder = write_scripted_model(tmp_path_factory.mktemp("fenced") / "model", opener=OPENER, closer=CLOSER)
    model = start_served_model(resolve_model(str(folder)), RuntimeOptions(warmup=False, quantize="off"),
                               EngineConfig(max_num_seqs=2, ctx_size=4096))
    yield model
    model.close(30)


@pytest.fixture(scope="module")
def sdk(fenced: ServedModel, start_server: Callable[..., ServerThread]) -> Iterator[openai.OpenAI]:
    server = start_server(fenced)
    with openai.OpenAI(base_url=server.address + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def chat(sdk: openai.OpenAI, tools: list[dict[str, Any]], *, stream: bool) -> Any:
    fields: dict[str, Any] = {"model": "m", "messages": QUESTION, "tools": tools, "temperature": 0, "max_tokens": 80}
    if stream:
        with sdk.chat.completions.stream(**fields) as events:
            return events.get_final_completion().choices[0]
    return sdk.chat.completions.create(**fields).choices[0]


@pytest.mark.parametrize("stream", [False, True])
def test_issue26_fenced_call_to_a_declared_tool_is_a_tool_call(sdk: openai.OpenAI, stream: bool) -> None:
    choice = chat(sdk, [WEATHER_TOOL, PING_TOOL], stream=stream)
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("stream", [False, True])
def test_issue26_fenced_call_to_an_undeclared_tool_stays_text(sdk: openai.OpenAI, stream: bool) -> None:
    choice = chat(sdk, [PING_TOOL], stream=stream)
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == "I will check.\n" + BLOCK


def test_issue26_fenced_call_without_tools_is_text(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=80).choices[0]
    assert reply.message.content == "I will check.\n" + BLOCK and not reply.message.tool_calls


def test_issue26_fenced_call_over_responses(sdk: openai.OpenAI) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL["function"]["parameters"]}
    response = sdk.responses.create(model="m", input="Weather in Paris?", tools=[tool], temperature=0,
                                    max_output_tokens=80, store=False)
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("stream", [False, True])
def test_issue26_fenced_call_over_anthropic_messages(sdk: openai.OpenAI, stream: bool) -> None:
    tools = [{"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}]
    base_url = str(sdk.base_url).removesuffix("/v1/")
    with anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=60) as claude:
        fields: dict[str, Any] = {"model": "claude-x", "max_tokens": 80, "messages": QUESTION, "tools": tools,
                                  "extra_body": {"temperature": 0}}
        if stream:
            with claude.messages.stream(**fields) as events:
                message = events.get_final_message()
        else:
            message = claude.messages.create(**fields)
    assert message.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "text", None)) for b in message.content][0] == ("text", "I will check.")
    assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == [("get_weather", {"city": "Paris"})]
