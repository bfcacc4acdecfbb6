"""Anthropic Messages (E1, E2, D1, C1) on the real default model, driven by the official `anthropic` SDK
and httpx: create, stream, count_tokens, any model name, system blocks, stop sequences, content
blocks, the billing-stamp pin and its prefix-cache hit, auth headers and every error envelope.

All at temperature 0 with a handful of tokens, so outputs are deterministic and cheap.
"""

from __future__ import annotations

import base64
import io
import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import anthropic
import httpx
import pytest
from PIL import Image

from mlxcel.serving.served_model import ServedModel
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread

from .conftest import SERVER, chat_body

pytestmark = pytest.mark.slow
MODEL = "claude-sonnet-5-5"
HI = [{"role": "user", "content": "Hi"}]
T0 = {"temperature": 0}  # this SDK has no sampling arguments; the server still reads them (greedy here)
EXACT_401 = {"error": {"message": "Invalid API key", "type": "invalid_api_key"}}


@pytest.fixture()
def claude(server: ServerThread) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.address, api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


def message_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 6, "temperature": 0, "messages": HI, **fields}


def sse_events(client: httpx.Client, body: dict[str, Any], path: str = "/v1/messages") -> list[tuple[str, Any]]:
    """(event name, data) pairs of a Messages stream."""
    events = []
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                events.append((name, data))
    return events


# ---- E1 with the SDK ----

def test_e1_create_matches_chat_and_reports_usage(claude: anthropic.Anthropic, client: httpx.Client) -> None:
    message = claude.messages.create(model=MODEL, max_tokens=6, extra_body=T0, messages=HI)
    chat = client.post("/v1/chat/completions", json=chat_body(max_tokens=6)).json()
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.model == MODEL  # any model name maps to the served model and is echoed
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat["choices"][0]["message"]["content"]
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    usage = message.usage
    assert usage.output_tokens == 6 and usage.cache_creation_input_tokens == 0
    assert usage.input_tokens + usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]


def test_e1_stream_assembles_the_same_message(claude: anthropic.Anthropic) -> None:
    whole = claude.messages.create(model=MODEL, max_tokens=6, extra_body=T0, messages=HI)
    with claude.messages.stream(model=MODEL, max_tokens=6, extra_body=T0, messages=HI) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens)


def test_e1_stream_event_sequence(client: httpx.Client) -> None:
    events = sse_events(client, message_body())
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert all(data["delta"]["type"] == "text_delta" for _, data in events[3:-3])
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 6


def test_e1_end_turn(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(model=MODEL, max_tokens=40, extra_body=T0, messages=HI)
    assert message.stop_reason == "end_turn" and message.usage.output_tokens < 40


def test_e1_count_tokens(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(model=MODEL, max_tokens=1, extra_body=T0, messages=HI, system="Be brief.")
    counted = claude.messages.count_tokens(model=MODEL, messages=HI, system="Be brief.")
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_e1_system_blocks_equal_the_joined_string(claude: anthropic.Anthropic) -> None:
    blocks = [{"type": "text", "text": "You are terse."},
              {"type": "text", "text": "Answer in French.", "cache_control": {"type": "ephemeral"}}]
    as_blocks = claude.messages.create(model=MODEL, max_tokens=5, extra_body=T0, messages=HI, system=blocks)
    as_text = claude.messages.create(model=MODEL, max_tokens=5, extra_body=T0, messages=HI,
                                     system="You are terse.\nAnswer in French.")
    assert as_blocks.content[0].text == as_text.content[0].text
    assert claude.messages.count_tokens(model=MODEL, messages=HI, system=blocks).input_tokens == (
        claude.messages.count_tokens(model=MODEL, messages=HI, system="You are terse.\nAnswer in French.").input_tokens)


def test_e1_stop_sequences(claude: anthropic.Anthropic) -> None:
    text = claude.messages.create(model=MODEL, max_tokens=8, extra_body=T0, messages=HI).content[0].text
    stop = text[2:5]
    message = claude.messages.create(model=MODEL, max_tokens=8, extra_body=T0, messages=HI, stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[:text.index(stop)]
    with claude.messages.stream(model=MODEL, max_tokens=8, extra_body=T0, messages=HI,
                                stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", stop,
                                                                               text[:text.index(stop)])


def test_e1_tool_thinking_and_tool_result_blocks_render(claude: anthropic.Anthropic) -> None:
    tools = [{"name": "get_weather", "description": "Weather of a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call the tool.", "signature": "sig"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C, sunny"}]},
            {"type": "text", "text": "Thanks!"}]},
    ]
    message = claude.messages.create(model=MODEL, max_tokens=3, extra_body=T0, messages=messages, tools=tools,
                                     tool_choice={"type": "auto"}, metadata={"user_id": "u-1"})
    assert message.usage.output_tokens == 3
    without_tools = claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    assert claude.messages.count_tokens(model=MODEL, messages=messages, tools=tools).input_tokens >= without_tools


def test_e1_headers_beta_query_and_model_names(client: httpx.Client, claude: anthropic.Anthropic) -> None:
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "prompt-caching-2024-07-31"}
    for path in ("/v1/messages?beta=true", "/messages", "/v1/messages"):
        assert client.post(path, json=message_body(max_tokens=1), headers=headers).status_code == 200, path
    beta = claude.beta.messages.create(model=MODEL, max_tokens=1, extra_body=T0, messages=HI,
                                       betas=["interleaved-thinking-2025-05-14"])
    assert beta.usage.output_tokens == 1
    assert client.post("/messages", json=message_body(model="SmolLM2-135M-Instruct", max_tokens=1)).status_code == 200


def test_e1_any_model_name_is_the_served_model(claude: anthropic.Anthropic, client: httpx.Client) -> None:
    """As on the OpenAI routes (issue 26): LiteLLM's `anthropic/<name>` sends a local model's name."""
    reference = claude.messages.create(model=MODEL, max_tokens=4, extra_body=T0, messages=HI)
    for name in ("gpt-4o", "qwen2.5-coder-1.5b-instruct", "x"):
        message = claude.messages.create(model=name, max_tokens=4, extra_body=T0, messages=HI)
        assert message.model == name and message.content[0].text == reference.content[0].text
        assert claude.messages.count_tokens(model=name, messages=HI).input_tokens == (
            reference.usage.input_tokens + reference.usage.cache_read_input_tokens)


WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
FORCED = {"type": "tool", "name": "get_weather"}
PARIS = [{"role": "user", "content": "Weather in Paris?"}]


def test_e1_forced_tool_use_is_the_first_block_with_a_toolu_id(claude: anthropic.Anthropic) -> None:
    """No empty text block before a tool_use (Anthropic never sends one), ids `toolu_` (issue 26)."""
    message = claude.messages.create(model=MODEL, max_tokens=40, extra_body=T0, messages=PARIS, tools=[WEATHER],
                                     tool_choice=FORCED)
    assert [block.type for block in message.content] == ["tool_use"]
    [call] = message.content
    assert call.name == "get_weather" and call.id.startswith("toolu_") and len(call.id) == 30
    assert isinstance(call.input, dict) and isinstance(call.input["city"], str)
    assert message.stop_reason == "tool_use"
    with claude.messages.stream(model=MODEL, max_tokens=40, extra_body=T0, messages=PARIS, tools=[WEATHER],
                                tool_choice=FORCED) as stream:
        started = [event.content_block for event in stream if event.type == "content_block_start"]
        final = stream.get_final_message()
    assert [block.type for block in started] == ["tool_use"] and started[0].id.startswith("toolu_")
    assert [block.type for block in final.content] == ["tool_use"] and final.content[0].input == call.input
    # the id the client sends back is taken as it is
    follow = claude.messages.create(model=MODEL, max_tokens=2, extra_body=T0, tools=[WEATHER], messages=[
        *PARIS, {"role": "assistant", "content": [call.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18C"}]}])
    assert follow.usage.output_tokens >= 1


def test_e1_image_blocks_validated_then_refused(client: httpx.Client) -> None:
    png = io.BytesIO()
    Image.new("RGB", (4, 4), "red").save(png, format="PNG")
    good = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": base64.b64encode(png.getvalue()).decode()}}
    bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"}}
    for block, needle in ((good, "does not accept image input"), (bad, "image")):
        body = message_body(messages=[{"role": "user", "content": [block, {"type": "text", "text": "What?"}]}])
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            response = client.post(path, json=body)
            assert response.status_code == 400, response.text
            error = response.json()
            assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
            assert needle in error["error"]["message"]
    assert "does not accept" not in client.post("/v1/messages", json=message_body(
        messages=[{"role": "user", "content": [bad]}])).json()["error"]["message"]


# ---- E2: billing stamp ----

def billing_request(cch: str, session: str, nonce: str) -> dict[str, Any]:
    stamp = f"x-anthropic-billing-header: cc_version=2.1.39.{session}; cc_entrypoint=cli; cch={cch};"
    system = [{"type": "text", "text": stamp},
              {"type": "text", "text": f"You are a careful assistant ({nonce}). Keep every answer short, plain and "
                                       "kind, and never use lists or headings in a reply."}]
    return message_body(max_tokens=1, system=system)


def test_e2_pinned_stamp_hits_the_prefix_cache(client: httpx.Client) -> None:
    nonce = uuid.uuid4().hex
    first = client.post("/v1/messages", json=billing_request("12345", "a1b", nonce)).json()["usage"]
    second = client.post("/v1/messages", json=billing_request("67890", "c2d", nonce)).json()["usage"]
    total = second["input_tokens"] + second["cache_read_input_tokens"]
    assert first["cache_read_input_tokens"] < 32 <= second["cache_read_input_tokens"]
    assert second["cache_read_input_tokens"] >= total - 16  # all but the last partial block


def test_e2_pin_disabled_keeps_the_stamp(served: ServedModel, start_server: Callable[..., ServerThread]) -> None:
    unpinned = start_server(served, replace(SERVER, anthropic_pin_billing_stamp=False))
    nonce = uuid.uuid4().hex
    with httpx.Client(base_url=unpinned.address, timeout=120) as http:
        http.post("/v1/messages", json=billing_request("12345", "a1b", nonce))
        second = http.post("/v1/messages", json=billing_request("67890", "c2d", nonce)).json()["usage"]
    # The stamps differ a few tokens in, so at most the block before them is shared.
    assert second["cache_read_input_tokens"] <= 16


# ---- C1 and D1 ----

def test_e1_system_message_in_messages_renders_where_it_stands(claude: anthropic.Anthropic,
                                                               client: httpx.Client) -> None:
    """Issue 26: Claude Code 2.1.3xx sends `{"role": "system"}` in `messages` (its environment block)."""
    turns = [{"role": "user", "content": "Hi"}, {"role": "system", "content": [{"type": "text", "text": "Be terse."}]},
             {"role": "user", "content": "Again"}]
    plain = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Again"}]
    with_system = claude.messages.count_tokens(model=MODEL, messages=turns).input_tokens
    assert with_system > claude.messages.count_tokens(model=MODEL, messages=plain).input_tokens
    as_string = [turns[0], {"role": "system", "content": "Be terse."}, turns[2]]
    assert claude.messages.count_tokens(model=MODEL, messages=as_string).input_tokens == with_system
    reply = client.post("/v1/messages", json=message_body(messages=turns))
    assert reply.status_code == 200 and reply.json()["content"][0]["type"] == "text", reply.text
    image = {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:9/x.png"}}
    refused = client.post("/v1/messages", json=message_body(messages=[turns[0], {"role": "system",
                                                                                  "content": [image]}]))
    assert refused.status_code == 400 and "system message holds text blocks only" in refused.text, refused.text


@pytest.fixture(scope="module")
def bare_server(start_server: Callable[..., ServerThread]) -> ServerThread:
    """No model: every body check must answer before the availability check (D1)."""
    return start_server(None, ServerConfig(port=0, max_body_bytes=4096))


@pytest.mark.parametrize("path", ["/v1/messages", "/messages", "/v1/messages/count_tokens", "/messages/count_tokens"])
def test_d1_anthropic_body_errors(bare_server: ServerThread, path: str) -> None:
    valid = message_body()
    with httpx.Client(base_url=bare_server.address, timeout=30) as http:
        for raw in (b"{", b"", b'{"model": "m",}'):
            response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
            assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
            assert response.json()["type"] == "error"
        cases = [{k: v for k, v in valid.items() if k != "messages"}, {**valid, "model": 5},
                 {**valid, "messages": [{"role": "user", "content": [{"type": "document"}]}]}]
        if "count_tokens" not in path:
            cases.append({k: v for k, v in valid.items() if k != "max_tokens"})
            cases.append({**valid, "temperature": 1.5})
        for case in cases:
            response = http.post(path, json=case)
            assert response.status_code == 400, case
            assert response.json()["error"]["type"] == "invalid_request_error"
        plain = http.post(path, content=json.dumps(valid).encode(), headers={"Content-Type": "text/plain"})
        assert plain.status_code == 415
        assert plain.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                           "message": plain.json()["error"]["message"]}}
        big = http.post(path, json={**valid, "pad": "x" * 5000})
        assert big.status_code == 413 and big.json()["error"]["code"] == 413 and "type" not in big.json()
        loading = http.post(path, json=valid)
        assert loading.status_code == 503
        assert loading.json() == {"type": "error", "error": {"type": "overloaded_error", "message": "Loading model"}}


def test_d1_missing_max_tokens_names_it(bare_server: ServerThread) -> None:
    with httpx.Client(base_url=bare_server.address, timeout=30) as http:
        body = {k: v for k, v in message_body().items() if k != "max_tokens"}
        assert "max_tokens" in http.post("/v1/messages", json=body).json()["error"]["message"]


def test_c1_x_api_key_and_bearer(served: ServedModel, start_server: Callable[..., ServerThread]) -> None:
    keyed = start_server(served, replace(SERVER, api_keys=("sk-ant-test",)))
    with anthropic.Anthropic(base_url=keyed.address, api_key="sk-ant-test", max_retries=0) as sdk:  # x-api-key
        assert sdk.messages.count_tokens(model=MODEL, messages=HI).input_tokens > 0
    with anthropic.Anthropic(base_url=keyed.address, auth_token="sk-ant-test", max_retries=0) as sdk:  # Bearer
        assert sdk.messages.create(model=MODEL, max_tokens=1, messages=HI).usage.output_tokens == 1
    with httpx.Client(base_url=keyed.address, timeout=30) as http:
        for headers in ({}, {"x-api-key": "wrong"}):
            response = http.post("/v1/messages", json=message_body(), headers=headers)
            assert response.status_code == 401 and response.json() == EXACT_401  # C1's exact body everywhere
