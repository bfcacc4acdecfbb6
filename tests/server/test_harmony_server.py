"""Issue 40 (V, R): gpt-oss harmony output through the real server and the real OpenAI SDK.

The checkpoint (harmony_model.py) writes what gpt-oss writes for a weather question: an
`analysis` message, then a `commentary` message to `functions.get_weather` that ends on the
`<|call|>` stop token. Its chat template prints harmony's markers, so the server chooses the
harmony tool-call format and finds the reasoning markers in the vocabulary: the analysis comes
back as `reasoning_content` and the commentary message as a tool call, streamed and not.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from mlxcel.config import EngineConfig
from mlxcel.serving.chat_model import start_served_model
from mlxcel.serving.served_model import RuntimeOptions, ServedModel
from mlxcel.server.lifecycle import ServerThread
from tests.server.harmony_model import ARGUMENTS, REASONING_TEXT, write_harmony_model

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def harmony(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedModel]:
    from mlxcel.loading import resolve_model

    folder = write_harmony_model(tmp_path_factory.mktemp("harmony") / "model")
    model = start_served_model(resolve_model(str(folder)), RuntimeOptions(warmup=False, quantize="off"),
                               EngineConfig(max_num_seqs=2, ctx_size=4096))
    yield model
    model.close(30)


@pytest.fixture(scope="module")
def server_t(harmony: ServedModel, start_server: Callable[..., ServerThread]) -> ServerThread:
    return start_server(harmony)


@pytest.fixture()
def sdk(server_t: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server_t.address + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def test_issue40_harmony_is_chosen_from_the_template(server_t: ServerThread) -> None:
    """The fixture itself: without tools nothing reads calls, so the reply is the scripted
    call's text, in the canonical header the harmony splitter writes, after the reasoning."""
    assert httpx.get(server_t.address + "/health", timeout=30).json()["tool_call_parser"] == "harmony"
    body = {"messages": QUESTION, "temperature": 0, "max_tokens": 40}
    reply = httpx.post(server_t.address + "/v1/chat/completions", json=body, timeout=60).json()
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] == REASONING_TEXT
    assert message["content"] == (
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')


def test_issue40_harmony_reasoning_and_tool_call_through_the_sdk(sdk: openai.OpenAI) -> None:
    completion = sdk.chat.completions.create(model="m", messages=QUESTION, tools=[WEATHER], temperature=0,
                                             max_tokens=40)
    choice = completion.choices[0]
    assert choice.message.model_extra["reasoning_content"] == REASONING_TEXT
    assert not choice.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", ARGUMENTS)]
    assert choice.finish_reason == "tool_calls"


def test_issue40_harmony_streams_reasoning_deltas_then_the_call(sdk: openai.OpenAI) -> None:
    fields: dict[str, Any] = {"model": "m", "messages": QUESTION, "tools": [WEATHER], "temperature": 0,
                              "max_tokens": 40, "stream": True}
    chunks = [c for c in sdk.chat.completions.create(**fields) if c.choices]
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for call in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
    first_call = next(i for i, c in enumerate(chunks) if c.choices[0].delta.tool_calls)
    last_reasoning = max(i for i, c in enumerate(chunks) if c.choices[0].delta.model_extra.get("reasoning_content"))
    assert reasoning == REASONING_TEXT and not content and last_reasoning < first_call
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", ARGUMENTS)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_issue40_harmony_call_to_an_undeclared_tool_stays_text(sdk: openai.OpenAI) -> None:
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    completion = sdk.chat.completions.create(model="m", messages=QUESTION, tools=[other], temperature=0,
                                             max_tokens=40)
    message = completion.choices[0].message
    assert message.model_extra["reasoning_content"] == REASONING_TEXT and not message.tool_calls
    assert "to=functions.get_weather" in message.content and '{"city": "Paris"}' in message.content


def test_issue40_harmony_on_responses_gives_a_reasoning_item_and_a_function_call(sdk: openai.OpenAI) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    response = sdk.responses.create(model="m", input="Weather in Paris?", tools=[tool], temperature=0,
                                    max_output_tokens=40, store=False)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "function_call"], kinds
    assert REASONING_TEXT in response.output[0].model_dump_json()
    call = response.output[1]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", ARGUMENTS)
