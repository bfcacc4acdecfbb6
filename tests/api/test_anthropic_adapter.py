"""Anthropic Messages adapter (E1, E2, D1) with golden JSON: request -> template messages and the
engine Request, scripted TokenEvents -> the Message reply and the exact event stream, content
blocks for reasoning and tool calls, stop_reason mapping, billing-stamp pinning, error envelopes.
The engine is scripted (tests/api/scripted_engine.py); tokenizer and template are SmolLM2's."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from mlxcel.api.anthropic import AnthropicOptions, create_message, parse_count_tokens_request, parse_messages_request
from mlxcel.api.anthropic.billing import pin_billing_stamp
from mlxcel.api.anthropic.conversation import template_messages, template_tools
from mlxcel.api.anthropic.count_tokens import count_message_tokens
from mlxcel.api.anthropic.messages import collected_blocks, stop_reason
from mlxcel.api.anthropic.stream import PING_FRAME, ContentBlocks, message_events
from mlxcel.api.context import ApiContext
from mlxcel.api.errors import ApiError, error_body, invalid_api_key, invalid_request, unavailable
from mlxcel.api.generation import ChoiceResult, ChoiceTimings
from mlxcel.api.replies import JsonReply, StreamReply
from mlxcel.chat.events import ContentDelta, ReasoningDelta, ToolCall, ToolCallArguments, ToolCallEnd, ToolCallStart
from mlxcel.chat.output import ParsedReply
from mlxcel.text.tokenizer import Tokenizer
from mlxcel.types import FinishReason, Priority, SamplingParams

from .scripted_engine import ScriptedEngine, scripted_context, smollm2_metadata

PARIS = [7042, 30]  # " Paris."
EOS = 2
STAMP = "x-anthropic-billing-header: cc_version=2.1.39.c39; cc_entrypoint=cli; cch=56445;"
PINNED = "x-anthropic-billing-header: cc_version=2.1.39.fff; cc_entrypoint=cli; cch=fffff;"
BODY = {"model": "claude-opus-4-6", "max_tokens": 10, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture(scope="module")
def metadata() -> dict[str, Any]:
    return smollm2_metadata()


@pytest.fixture(scope="module")
def tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf(metadata)


def context(tokenizer: Tokenizer, metadata: dict[str, Any], engine: ScriptedEngine) -> ApiContext:
    return scripted_context(tokenizer, engine, metadata)


def create(ctx: ApiContext, body: dict[str, Any], headers: dict[str, str] | None = None,
           options: AnthropicOptions = AnthropicOptions()) -> JsonReply | StreamReply:
    return asyncio.run(create_message(ctx, parse_messages_request(body), headers or {}, options))


# ---- request -> template messages ----

def test_e1_blocks_to_template_messages_golden() -> None:
    req = parse_messages_request({
        "model": "claude-x", "max_tokens": 5,
        "system": [{"type": "text", "text": STAMP}, {"type": "text", "text": "Be brief.", "cache_control": {}}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Call the tool.", "signature": "s"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "n/a", "is_error": True},
                {"type": "text", "text": "Thanks"}, {"type": "text", "text": "!"}]},
            {"role": "assistant", "content": "You're welcome."},
        ],
    })
    assert template_messages(req, pin_billing_stamp=True) == [
        {"role": "system", "content": f"{PINNED}\nBe brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call the tool.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "n/a"},
        {"role": "user", "content": "Thanks\n!"},
        {"role": "assistant", "content": "You're welcome."},
    ]
    assert template_messages(req, pin_billing_stamp=False)[0]["content"] == f"{STAMP}\nBe brief."


def test_issue46_documented_blocks_are_read_as_text_and_unknown_ones_too(caplog: pytest.LogCaptureFixture) -> None:
    """Claude Code's tool search puts tool_reference blocks in a tool_result; search results, documents and a
    web search's history are text for a text model; a type nobody documents shows its text and is logged once."""
    req = parse_messages_request({**BODY, "messages": [
        {"role": "user", "content": "Find a tool."},
        {"role": "assistant", "content": [
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "bash"}},
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": [
                {"type": "web_search_result", "title": "Bash", "url": "https://x.test/bash", "encrypted_content": "e"}]},
            {"type": "tool_use", "id": "toolu_1", "name": "ToolSearch", "input": {"query": "select:Bash"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "tool_reference", "tool_name": "Bash"}, {"type": "text", "text": "found"},
                {"type": "brand_new_block", "text": "shown", "extra": 1}]},
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Doc body."},
             "title": "Notes", "context": "mine", "citations": {"enabled": True}},
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"}},
            {"type": "search_result", "source": "https://x.test", "title": "Hit",
             "content": [{"type": "text", "text": "Hit body."}]},
            {"type": "brand_new_block"}, {"type": "text", "text": "Go on."}]},
    ]})
    with caplog.at_level("WARNING"):
        messages = template_messages(req, pin_billing_stamp=False)
    assert messages == [
        {"role": "user", "content": "Find a tool."},
        {"role": "assistant", "content": 'web_search: {"query": "bash"}\nBash - https://x.test/bash',
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "ToolSearch", "arguments": {"query": "select:Bash"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Tool loaded: Bash\nfound\nshown"},
        {"role": "user", "content": "Notes\nmine\nDoc body.\n[document: application/pdf, not readable as text "
                                    "here]\nHit\nhttps://x.test\nHit body.\nGo on."},
    ]
    assert sum("brand_new_block" in r.getMessage() for r in caplog.records) <= 1  # once per type and process


def test_issue46_a_tool_use_cut_by_max_tokens_is_not_listed() -> None:
    """The non-streaming reply never shows a cut call as a tool_use with made-up input; stop_reason max_tokens."""
    reply = ParsedReply("Calling.", "", (ToolCall(0, "call_1", "f", '{"a": 1}'),
                                         ToolCall(1, "call_2", "f", '{"a": ', is_complete=False)))
    assert collected_blocks(reply, shows_thinking=False).content() == [
        {"type": "text", "text": "Calling."}, {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]


def test_e1_tools_become_functions() -> None:
    req = parse_messages_request({**BODY, "tools": [
        {"name": "weather", "description": "Weather", "input_schema": {"type": "object"}}, {"name": "now"}]})
    assert template_tools(req.tools) == [
        {"type": "function", "function": {"name": "weather", "description": "Weather",
                                          "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "now", "description": "",
                                          "parameters": {"type": "object", "properties": {}}}}]
    assert template_tools(None) is None


@pytest.mark.parametrize(("body", "needle"), [
    ({k: v for k, v in BODY.items() if k != "max_tokens"}, "max_tokens"),
    ({**BODY, "max_tokens": 0}, "max_tokens"),
    ({**BODY, "messages": []}, "messages"),
    ({**BODY, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({**BODY, "messages": [{"role": "system", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]},
     "text blocks only"),
    ({**BODY, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "document"),
    ({**BODY, "temperature": 1.5}, "temperature"),
    ({**BODY, "stop_sequences": "x"}, "stop_sequences"),
    ({**BODY, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
    ({**BODY, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
     "media_type"),
])
def test_d1_invalid_bodies(body: dict[str, Any], needle: str) -> None:
    with pytest.raises(ApiError) as raised:
        parse_messages_request(body)
    assert raised.value.status == 400 and needle in raised.value.message


def test_d1_count_tokens_needs_no_max_tokens() -> None:
    req = parse_count_tokens_request({k: v for k, v in BODY.items() if k != "max_tokens"})
    assert req.model == "claude-opus-4-6"


# ---- E2 ----

@pytest.mark.parametrize(("text", "pinned"), [
    (STAMP, PINNED),
    (STAMP + "\nYou are Claude Code. cch=123;", PINNED + "\nYou are Claude Code. cch=123;"),  # first line only
    ("x-anthropic-billing-header: cc_version=2.1.81.df2; cc_entrypoint=sdk-cli; cch=00000;",
     "x-anthropic-billing-header: cc_version=2.1.81.fff; cc_entrypoint=sdk-cli; cch=fffff;"),
    ("x-anthropic-billing-header: cc_version=2.1.81; cc_entrypoint=sdk-cli;",  # no 4th part, no cch
     "x-anthropic-billing-header: cc_version=2.1.81; cc_entrypoint=sdk-cli;"),
    (" " + STAMP, " " + STAMP),  # must start exactly with the stamp
    ("You are helpful. " + STAMP, "You are helpful. " + STAMP),
])
def test_e2_pin_billing_stamp(text: str, pinned: str) -> None:
    assert pin_billing_stamp(text) == pinned


def test_e2_only_the_top_level_system_is_pinned() -> None:
    req = parse_messages_request({**BODY, "system": STAMP, "messages": [{"role": "user", "content": STAMP}]})
    messages = template_messages(req, pin_billing_stamp=True)
    assert messages[0]["content"] == PINNED and messages[1]["content"] == STAMP


# ---- request -> engine Request; TokenEvents -> Message ----

def test_e1_request_fields_reach_the_engine(tokenizer: Tokenizer, metadata: dict[str, Any]) -> None:
    engine = ScriptedEngine([*PARIS, EOS])
    ctx = context(tokenizer, metadata, engine)
    body = {**BODY, "system": "Be brief.", "temperature": 0.3, "top_p": 0.9, "top_k": 5, "stop_sequences": ["!"],
            "metadata": {"user_id": "u"}}
    create(ctx, body, {"x-priority": "low"})
    [request] = engine.requests
    rendered = ctx.chat_template.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert request.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert request.sampling == SamplingParams(temperature=0.3, top_p=0.9, top_k=5, min_p=0.05, max_tokens=10)
    assert request.priority is Priority.LOW and request.cache_prompt is True
    create(ctx, BODY)
    # Issue 46: no sampling fields -> llama-server's defaults (no server flags, no checkpoint values here).
    assert engine.requests[1].sampling == SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, max_tokens=10)


def test_e1_message_golden(tokenizer: Tokenizer, metadata: dict[str, Any]) -> None:
    engine = ScriptedEngine([*PARIS, EOS], num_cached=16)
    ctx = context(tokenizer, metadata, engine)
    reply = create(ctx, BODY)
    assert isinstance(reply, JsonReply)
    body = reply.body
    num_prompt = len(engine.requests[0].prompt_token_ids)
    assert body["id"].startswith("msg_") and len(body["id"]) == 28
    assert {**body, "id": "msg"} == {
        "id": "msg", "type": "message", "role": "assistant", "model": "claude-opus-4-6",
        "content": [{"type": "text", "text": " Paris."}], "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": num_prompt - 16, "output_tokens": 3, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 16}}
    stopped = create(context(tokenizer, metadata, ScriptedEngine([*PARIS, EOS])), {**BODY, "stop_sequences": ["."]})
    assert (stopped.body["stop_reason"], stopped.body["stop_sequence"], stopped.body["content"][0]["text"]) == (
        "stop_sequence", ".", " Paris")
    limited = create(context(tokenizer, metadata, ScriptedEngine(PARIS, FinishReason.LENGTH)), BODY)
    assert limited.body["stop_reason"] == "max_tokens"


def stream_events(reply: StreamReply) -> list[tuple[str, Any]]:
    async def collect() -> list[str]:
        return [frame async for frame in reply.frames]

    events = []
    for frame in asyncio.run(collect()):
        head, data = frame.removesuffix("\n\n").split("\n")
        events.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def test_e1_stream_golden(tokenizer: Tokenizer, metadata: dict[str, Any]) -> None:
    engine = ScriptedEngine([*PARIS, EOS], num_cached=16)
    reply = create(context(tokenizer, metadata, engine), {**BODY, "stream": True})
    assert isinstance(reply, StreamReply)
    events = stream_events(reply)
    num_prompt = len(engine.requests[0].prompt_token_ids)
    message_id = events[0][1]["message"]["id"]
    paris, dot = (tokenizer.decode([t]) for t in PARIS)
    assert events == [
        ("message_start", {"type": "message_start", "message": {
            "id": message_id, "type": "message", "role": "assistant", "model": "claude-opus-4-6", "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": num_prompt, "output_tokens": 0, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0}}}),
        ("ping", {"type": "ping"}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": paris}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": dot}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": {"input_tokens": num_prompt - 16, "output_tokens": 3,
                                     "cache_creation_input_tokens": 0, "cache_read_input_tokens": 16}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    assert PING_FRAME == 'event: ping\ndata: {"type":"ping"}\n\n'


def test_e1_count_tokens_golden(tokenizer: Tokenizer, metadata: dict[str, Any]) -> None:
    ctx = context(tokenizer, metadata, ScriptedEngine([EOS]))
    req = parse_count_tokens_request({"model": "claude-x", "messages": BODY["messages"], "system": "Be brief."})
    reply = asyncio.run(count_message_tokens(ctx, req, AnthropicOptions()))
    rendered = ctx.chat_template.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert reply.body == {"input_tokens": len(tokenizer.encode(rendered, add_special_tokens=False))}
    # any model name is the served model, as on the OpenAI routes (issue 26)
    other = asyncio.run(count_message_tokens(ctx, parse_count_tokens_request({**req.model_dump(), "model": "gpt-4"}),
                                             AnthropicOptions()))
    assert other.body == reply.body


# ---- content blocks for reasoning and tool calls (the output parser's events) ----

def test_e1_content_blocks_for_thinking_text_and_tool_use() -> None:
    blocks = ContentBlocks()
    events = [ReasoningDelta("Let me "), ReasoningDelta("think."), ContentDelta("Calling."), ContentDelta(""),
              ToolCallStart(0, "call_9", "weather"), ToolCallArguments(0, '{"city": '),
              ToolCallArguments(0, '"Paris"}'), ToolCallEnd(0, "call_9", "weather", '{"city": "Paris"}')]
    payloads = [p for event in events for p in blocks.feed(event)] + blocks.close()
    assert payloads == [
        {"type": "content_block_start", "index": 0,
         "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Let me "}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "think."}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Calling."}},
        {"type": "content_block_stop", "index": 1},
        {"type": "content_block_start", "index": 2,
         "content_block": {"type": "tool_use", "id": "toolu_9", "name": "weather", "input": {}}},
        {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": '{"city": '}},
        {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": '"Paris"}'}},
        {"type": "content_block_stop", "index": 2},
    ]
    assert blocks.content() == [
        {"type": "thinking", "thinking": "Let me think.", "signature": ""},
        {"type": "text", "text": "Calling."},
        {"type": "tool_use", "id": "toolu_9", "name": "weather", "input": {"city": "Paris"}},
    ]
    assert blocks.has_tool_use


def test_e1_blocks_open_with_their_first_output() -> None:
    """A call first is the first block (no empty text block before it); no output is one empty text block."""
    blocks = ContentBlocks()
    payloads = [p for event in (ContentDelta(""), ToolCallStart(0, "call_x", "f"), ToolCallEnd(0, "call_x", "f", "{}"))
                for p in blocks.feed(event)] + blocks.finish()
    assert [p["type"] for p in payloads] == ["content_block_start", "content_block_stop"]
    assert blocks.content() == [{"type": "tool_use", "id": "toolu_x", "name": "f", "input": {}}]
    empty = ContentBlocks()
    assert [p["type"] for p in empty.finish()] == ["content_block_start", "content_block_stop"]
    assert empty.content() == [{"type": "text", "text": ""}]


def result(finish: str, stop: str | None = None) -> ChoiceResult:
    return ChoiceResult(0, 0, "x", (1,), (), finish, stop, 5, 0, ChoiceTimings(0.0, 0.1, 0.2))


def test_e1_stop_reason_mapping() -> None:
    assert stop_reason(result("stop"), has_tool_use=False) == ("end_turn", None)
    assert stop_reason(result("stop", "END"), has_tool_use=False) == ("stop_sequence", "END")
    assert stop_reason(result("length"), has_tool_use=False) == ("max_tokens", None)
    assert stop_reason(result("stop"), has_tool_use=True) == ("tool_use", None)
    assert stop_reason(result("length"), has_tool_use=True) == ("max_tokens", None)  # a cut-off call


# ---- D1 envelopes ----

def test_d1_anthropic_envelopes() -> None:
    assert error_body(invalid_request("bad field"), "anthropic") == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad field"}}
    assert error_body(invalid_request("no json", status=415), "anthropic")["error"]["type"] == "invalid_request_error"
    assert error_body(unavailable("Loading model"), "anthropic")["error"]["type"] == "overloaded_error"
    assert error_body(ApiError(404, "nope", "not_found_error"), "anthropic")["error"]["type"] == "not_found_error"
    assert error_body(ApiError(500, "bug", "server_error"), "anthropic")["error"]["type"] == "api_error"
    assert error_body(invalid_api_key(), "anthropic")["error"]["type"] == "authentication_error"
    too_big = ApiError(413, "too big", "invalid_request_error", code=413)
    assert error_body(too_big, "anthropic") == {"error": {"message": "too big", "type": "invalid_request_error",
                                                          "code": 413}}  # 413 keeps the OpenAI envelope (D1)


# ---- A9 pings while silent; a failure after the headers is an error event ----

def test_e1_pings_while_silent_and_error_event() -> None:
    async def slow_then_fail() -> Any:
        await asyncio.sleep(0.35)
        yield {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "late"}}
        raise ApiError(504, "no token for 600 s", "timeout_error", code=504)

    async def collect() -> list[str]:
        start = {"type": "message_start", "message": {}}
        return [frame async for frame in message_events(start, slow_then_fail(), 0.1)]

    frames = asyncio.run(collect())
    assert frames[:2] == ['event: message_start\ndata: {"type":"message_start","message":{}}\n\n', PING_FRAME]
    late = frames.index('event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
                        '"delta":{"type":"text_delta","text":"late"}}\n\n')
    assert late >= 4 and set(frames[1:late]) == {PING_FRAME}  # at least two pings while silent
    assert frames[late + 1:] == ['event: error\ndata: {"type":"error","error":{"type":"timeout_error",'
                                 '"message":"no token for 600 s"}}\n\n']
