"""Structured output and forced tool calls on the real default model (SmolLM2), through the server
(V): response_format json_schema / json_object, llama-server json_schema and GBNF grammar, every
output validated with `jsonschema`; a constrained and a free request sharing a batch."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from mlxcel.server.lifecycle import ServerThread
from tests.server.conftest import chat_body

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = "Give me a person as JSON."
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                          "required": ["city"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture()
def sdk(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.address + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def schema_format(strict: bool = True) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": strict}}


def test_v_health_reports_generic_tool_calls_for_smollm2(client: httpx.Client) -> None:
    assert client.get("/health").json()["tool_call_parser"] == "generic"


def test_v_json_schema_response_validates(sdk: openai.OpenAI) -> None:
    completion = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": ASK}], temperature=0,
                                             max_tokens=40, response_format=schema_format())
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_v_json_schema_streamed_validates(sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": ASK}], temperature=0,
                                         max_tokens=40, response_format=schema_format(strict=False), stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_v_json_object(sdk: openai.OpenAI) -> None:
    completion = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "Describe a cat."}],
                                             temperature=0, max_tokens=60, response_format={"type": "json_object"})
    assert isinstance(json.loads(completion.choices[0].message.content), dict)


def test_v_llama_server_json_schema_and_gbnf_on_completion(client: httpx.Client) -> None:
    native = client.post("/completion", json={"prompt": "A person: ", "n_predict": 40, "temperature": 0,
                                              "json_schema": PERSON}).json()
    jsonschema.validate(json.loads(native["content"]), PERSON)
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    gbnf = client.post("/completion", json={"prompt": "Is water wet?", "n_predict": 12, "temperature": 0,
                                            "grammar": grammar}).json()
    assert gbnf["content"] in ("The answer is yes.", "The answer is no.")
    openai_style = client.post("/v1/completions", json={"prompt": "Is water wet?", "max_tokens": 12,
                                                         "temperature": 0, "grammar": grammar}).json()
    assert openai_style["choices"][0]["text"] in ("The answer is yes.", "The answer is no.")


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
    {"grammar": "root ::= ("},
    {"response_format": {"type": "xml"}},
])  # fmt: skip
def test_v_invalid_constraints_are_400s_before_streaming(client: httpx.Client, fields: dict[str, Any]) -> None:
    reply = client.post("/v1/chat/completions", json=chat_body(stream=True, **fields))
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


def test_v_constrained_and_free_requests_share_a_batch(client: httpx.Client) -> None:
    constrained = chat_body(ASK, max_tokens=40, response_format=schema_format())
    free = chat_body("Say hello.", max_tokens=12)
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda body: client.post("/v1/chat/completions", json=body).json(),
                                [constrained, free]))
    jsonschema.validate(json.loads(replies[0]["choices"][0]["message"]["content"]), PERSON)
    text = replies[1]["choices"][0]["message"]["content"]
    assert text and not text.lstrip().startswith("{")  # the free one was not masked


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_v_forced_tool_call_is_well_formed(sdk: openai.OpenAI, tool_choice: Any) -> None:
    completion = sdk.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "What is the weather in Paris?"}], temperature=0,
        max_tokens=60, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=tool_choice, parallel_tool_calls=False)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    tool = WEATHER_TOOL if call.function.name == "get_weather" else TIME_TOOL
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_v_forced_tool_call_streamed_by_the_sdk_helper(sdk: openai.OpenAI) -> None:
    with sdk.chat.completions.stream(
        model="m", messages=[{"role": "user", "content": "Weather in Rome?"}], temperature=0, max_tokens=60,
        tools=[WEATHER_TOOL], tool_choice="required",
    ) as stream:
        completion = stream.get_final_completion()
    calls = completion.choices[0].message.tool_calls  # parallel calls allowed: every one well-formed
    assert calls and completion.choices[0].finish_reason == "tool_calls"
    assert [c.index for c in calls] == list(range(len(calls))) and len({c.id for c in calls}) == len(calls)
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])


def test_v_responses_text_format_json_schema(sdk: openai.OpenAI) -> None:
    response = sdk.responses.create(model="m", input=ASK, temperature=0, max_output_tokens=40, store=False,
                                    text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                     "strict": True}})
    jsonschema.validate(json.loads(response.output_text), PERSON)


@pytest.mark.parametrize("field", ["output_format", "output_config"])
def test_v_anthropic_output_format_json_schema(client: httpx.Client, field: str) -> None:
    fmt = {"type": "json_schema", "schema": PERSON}
    body = {"model": "claude-x", "max_tokens": 40, "temperature": 0, "messages": [{"role": "user", "content": ASK}],
            field: fmt if field == "output_format" else {"format": fmt}}
    message = client.post("/v1/messages", json=body).json()
    jsonschema.validate(json.loads(message["content"][0]["text"]), PERSON)


# ---- issue 26 point 3: a forced tool call with an output format (instructor's RESPONSES_TOOLS) ----

def test_v_forced_tool_with_response_format_is_the_call(sdk: openai.OpenAI) -> None:
    """The forced call is the output; the format would apply to text (OpenAI accepts both)."""
    completion = sdk.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "What is the weather in Paris?"}], temperature=0,
        max_tokens=60, tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        response_format=schema_format(), parallel_tool_calls=False)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    free = sdk.chat.completions.create(  # tool_choice auto with the same format: the format still applies
        model="m", messages=[{"role": "user", "content": ASK}], temperature=0, max_tokens=40,
        tools=[WEATHER_TOOL], tool_choice="none", response_format=schema_format())
    jsonschema.validate(json.loads(free.choices[0].message.content), PERSON)


@pytest.mark.parametrize("stream", [False, True])
def test_v_responses_forced_tool_with_text_format_is_the_call(sdk: openai.OpenAI, stream: bool) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL["function"]["parameters"],
            "strict": True}
    fields: dict[str, Any] = dict(
        model="m", input="What is the weather in Paris?", temperature=0, max_output_tokens=60, store=False,
        tools=[tool], tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    if stream:
        with sdk.responses.stream(**fields) as events:
            response = events.get_final_response()
    else:
        response = sdk.responses.create(**fields)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_TOOL["function"]["parameters"])


# ---- issue 46: a forced named tool is one call; a call cut by the token limit is never shown as complete ----

NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_issue46_a_named_tool_is_exactly_one_call_whatever_the_seed(sdk: openai.OpenAI, client: httpx.Client) -> None:
    """No parallel_tool_calls sent (instructor's TOOLS mode): the grammar ends after the one call, on chat, Responses
    and Messages, sampled at temperature 1."""
    sdk = sdk.with_options(timeout=600)  # the module's first sampled requests: a busy 2-core machine is slow
    for seed in range(2):
        choice = sdk.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Weather in Paris, Rome and Oslo?"}], temperature=1.0,
            seed=seed, max_tokens=60, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=NAMED).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
        response = sdk.responses.create(
            model="m", input="Weather in Paris, Rome and Oslo?", temperature=1.0, extra_body={"seed": seed},
            max_output_tokens=60,
            store=False, tool_choice={"type": "function", "name": "get_weather"},
            tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL["function"]["parameters"]}])
        assert response.status == "completed" and [i.type for i in response.output] == ["function_call"]
    anthropic_tool = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}
    for _ in range(2):
        message = client.post("/v1/messages", json={
            "model": "c", "max_tokens": 60, "temperature": 1.0, "tools": [anthropic_tool],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "messages": [{"role": "user", "content": "Weather in Paris, Rome and Oslo?"}]}).json()
        assert message["stop_reason"] == "tool_use" and [b["type"] for b in message["content"]] == ["tool_use"]


def test_issue46_a_call_cut_by_the_token_limit_is_truncated_in_each_protocols_terms(
        sdk: openai.OpenAI, client: httpx.Client) -> None:
    """max_tokens ends the forced call mid-arguments: OpenAI says finish_reason length and shows the arguments as
    written (never a made-up "{}" or closed JSON), Responses an incomplete call, Messages max_tokens and no tool_use."""
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = sdk.chat.completions.create(model="m", messages=question, temperature=0, max_tokens=8,
                                         tools=[WEATHER_TOOL], tool_choice=NAMED).choices[0]
    assert choice.finish_reason == "length"
    for call in choice.message.tool_calls or ():
        with pytest.raises(ValueError):
            json.loads(call.function.arguments)
    with sdk.chat.completions.create(model="m", messages=question, temperature=0, max_tokens=8, stream=True,
                                     tools=[WEATHER_TOOL], tool_choice=NAMED) as stream:
        chunks = list(stream)
    streamed = "".join(c.choices[0].delta.tool_calls[0].function.arguments or "" for c in chunks
                       if c.choices and c.choices[0].delta.tool_calls)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert streamed == "".join(call.function.arguments for call in choice.message.tool_calls or ())
    response = sdk.responses.create(
        model="m", input="What is the weather in Paris?", temperature=0, max_output_tokens=8, store=False,
        tool_choice={"type": "function", "name": "get_weather"},
        tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL["function"]["parameters"]}])
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert all(item.status == "incomplete" for item in response.output if item.type == "function_call")
    message = client.post("/v1/messages", json={
        "model": "c", "max_tokens": 8, "temperature": 0, "messages": question,
        "tools": [{"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}],
        "tool_choice": {"type": "tool", "name": "get_weather"}}).json()
    assert message["stop_reason"] == "max_tokens" and all(b["type"] != "tool_use" for b in message["content"])
