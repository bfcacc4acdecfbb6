"""Responses events (F2) as golden JSON: output deltas -> the documented event sequence -> SSE.

Every event and every response object is also validated against the official openai SDK's
pydantic types, so a missing or misspelt field fails here before any client sees it.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from mlxcel.api.generation import LogprobText
from mlxcel.api.responses.objects import ResponseDraft, request_echo, usage_json
from mlxcel.api.responses.schemas import ResponseCreateRequest
from mlxcel.api.responses.stream import ResponseEvents, event_frame
from mlxcel.chat.events import ContentDelta, ReasoningDelta, ToolCallArguments, ToolCallEnd, ToolCallStart
from mlxcel.types import Usage

EVENT = TypeAdapter(ResponseStreamEvent)
USAGE = usage_json(Usage(prompt_tokens=12, completion_tokens=3, cached_tokens=8))


def builder(background: bool = False) -> ResponseEvents:
    numbers = itertools.count(1)
    draft = ResponseDraft("resp_1", "m", request_echo(ResponseCreateRequest(input="Hi")), created_at=100,
                          background=background, status="queued" if background else "in_progress")
    return ResponseEvents(draft, lambda prefix: f"{prefix}_{next(numbers)}")


def sdk_checked(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for event in events:
        EVENT.validate_python(event)
        if "response" in event:
            Response.model_validate(event["response"])
    return events


def shape(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """(sequence_number, type, the event's own fields but the bulky response object)."""
    return [(e["sequence_number"], e["type"], {k: v for k, v in e.items()
                                               if k not in ("type", "sequence_number", "response")}) for e in events]


def test_f2_text_reply_event_sequence_golden() -> None:
    events = builder()
    out = events.start() + events.feed(ContentDelta("Hel")) + events.feed(ContentDelta("lo"))
    out += events.finish("completed", usage=USAGE, completed_at=101)
    message = {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
               "content": [{"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}]}
    where = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    assert shape(sdk_checked(out)) == [
        (0, "response.created", {}),
        (1, "response.in_progress", {}),
        (2, "response.output_item.added", {"output_index": 0, "item": {**message, "status": "in_progress",
                                                                        "content": []}}),
        (3, "response.content_part.added", {**where, "part": {"type": "output_text", "text": "", "annotations": [],
                                                               "logprobs": []}}),
        (4, "response.output_text.delta", {**where, "delta": "Hel", "logprobs": []}),
        (5, "response.output_text.delta", {**where, "delta": "lo", "logprobs": []}),
        (6, "response.output_text.done", {**where, "text": "Hello", "logprobs": []}),
        (7, "response.content_part.done", {**where, "part": message["content"][0]}),
        (8, "response.output_item.done", {"output_index": 0, "item": message}),
        (9, "response.completed", {}),
    ]
    created, final = out[0]["response"], out[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    assert final["status"] == "completed" and final["output"] == [message] and final["usage"] == USAGE
    assert final["completed_at"] == 101 and final["incomplete_details"] is None
    assert Response.model_validate(final).output_text == "Hello"


def test_f2_usage_golden() -> None:
    assert USAGE == {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 8, "cache_write_tokens": 0},
                     "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 15}


def test_f2_background_starts_queued_and_token_limit_is_incomplete() -> None:
    events = builder(background=True)
    out = events.start() + events.feed(ContentDelta("Hi")) + events.finish("incomplete", usage=USAGE,
                                                                             incomplete_reason="max_output_tokens")
    sdk_checked(out)
    assert out[0]["response"]["status"] == "queued" and out[1]["response"]["status"] == "in_progress"
    assert out[-1]["type"] == "response.incomplete"
    final = out[-1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"} and final["completed_at"] is None
    assert final["output"][0]["status"] == "incomplete" and final["background"] is True


def test_f2_empty_reply_still_has_its_message() -> None:
    events = builder()
    out = events.start() + events.finish("completed", usage=USAGE, completed_at=1)
    assert [e["type"] for e in sdk_checked(out)][2:] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert out[-1]["response"]["output"][0]["content"][0]["text"] == ""


def test_f2_reasoning_then_text_then_tool_call_golden() -> None:
    """The seam for parsed output: each kind of OutputEvent becomes its own output item."""
    events = builder()
    out = events.start()
    out += events.feed(ReasoningDelta("think"))
    out += events.feed(ContentDelta("Let me check."))
    out += events.feed(ToolCallStart(0, "call_9", "weather"))
    out += events.feed(ToolCallArguments(0, "{\"city\":"))
    out += events.feed(ToolCallArguments(0, "\"Oslo\"}"))
    out += events.feed(ToolCallEnd(0, "call_9", "weather", "{\"city\":\"Oslo\"}"))
    out += events.finish("completed", usage=USAGE, completed_at=1)
    sdk_checked(out)
    assert [(e["type"], e.get("output_index")) for e in out[2:]] == [
        ("response.output_item.added", 0), ("response.content_part.added", 0), ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0), ("response.content_part.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.content_part.added", 1), ("response.output_text.delta", 1),
        ("response.output_text.done", 1), ("response.content_part.done", 1), ("response.output_item.done", 1),
        ("response.output_item.added", 2), ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.delta", 2), ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2), ("response.completed", None)]
    final = out[-1]["response"]["output"]
    assert final[0] == {"id": "rs_1", "type": "reasoning", "status": "completed", "summary": [],
                        "content": [{"type": "reasoning_text", "text": "think"}]}
    assert final[2] == {"id": "fc_3", "type": "function_call", "status": "completed", "call_id": "call_9",
                        "name": "weather", "arguments": "{\"city\":\"Oslo\"}"}


def test_f2_call_cut_by_the_limit_ends_incomplete() -> None:
    events = builder()
    out = events.start() + events.feed(ToolCallStart(0, "c", "f")) + events.feed(ToolCallArguments(0, "{\"a"))
    out += events.finish("incomplete", usage=USAGE, incomplete_reason="max_output_tokens")
    sdk_checked(out)
    assert out[-2]["type"] == "response.output_item.done" and out[-2]["item"]["status"] == "incomplete"


def test_f2_logprobs_on_deltas_and_in_the_part() -> None:
    events = builder()
    lp = LogprobText(5, "Hi", -0.5, (72, 105), top=(LogprobText(5, "Hi", -0.5, (72, 105)),
                                                     LogprobText(6, "Yo", -1.5, (89, 111))))
    out = events.start() + events.feed(ContentDelta("Hi"), (lp,)) + events.finish("completed", usage=USAGE)
    sdk_checked(out)
    delta = next(e for e in out if e["type"] == "response.output_text.delta")
    assert delta["logprobs"] == [{"token": "Hi", "logprob": -0.5, "top_logprobs": [
        {"token": "Hi", "logprob": -0.5}, {"token": "Yo", "logprob": -1.5}]}]
    part = out[-1]["response"]["output"][0]["content"][0]
    assert part["logprobs"] == [{"token": "Hi", "bytes": [72, 105], "logprob": -0.5, "top_logprobs": [
        {"token": "Hi", "bytes": [72, 105], "logprob": -0.5}, {"token": "Yo", "bytes": [89, 111], "logprob": -1.5}]}]


@pytest.mark.parametrize(("status", "terminal"), [("failed", "response.failed"), ("cancelled", None)])
def test_f2_failed_has_its_event_and_cancelled_has_none(status: str, terminal: str | None) -> None:
    events = builder()
    error = {"code": "server_error", "message": "boom"} if status == "failed" else None
    out = events.start() + events.feed(ContentDelta("x")) + events.finish(status, usage=USAGE, error=error)
    sdk_checked(out)
    assert (out[-1]["type"] if out[-1]["type"].startswith("response.f") else None) == terminal
    assert events.draft.status == status and events.draft.error == error


def test_f2_sse_frame_is_named_by_type() -> None:
    event = {"type": "response.output_text.delta", "sequence_number": 4, "delta": "é"}
    assert event_frame(event) == ('event: response.output_text.delta\n'
                                  'data: {"type":"response.output_text.delta","sequence_number":4,"delta":"é"}\n\n')


# ---- issue 26: custom and namespaced calls, sealed reasoning ----

def test_issue26_custom_and_namespaced_calls_come_back_as_declared() -> None:
    from mlxcel.api.responses.items import unseal_reasoning
    from mlxcel.api.responses.tools import parse_tools

    tools = parse_tools([{"type": "custom", "name": "apply_patch"},
                         {"type": "namespace", "name": "multi_agent_v1", "tools": [
                             {"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}]}])
    numbers = itertools.count(1)
    draft = ResponseDraft("resp_1", "m", request_echo(ResponseCreateRequest(input="Hi")), created_at=100)
    events = ResponseEvents(draft, lambda prefix: f"{prefix}_{next(numbers)}", tools=tools, seals_reasoning=True)
    out = events.start() + events.feed(ReasoningDelta("Plan."))
    out += events.feed(ToolCallStart(0, "call_a", "apply_patch")) + events.feed(ToolCallArguments(0, '{"input": '))
    out += events.feed(ToolCallEnd(0, "call_a", "apply_patch", '{"input": "*** Begin Patch"}'))
    out += events.feed(ToolCallStart(1, "call_b", "multi_agent_v1__spawn_agent"))
    out += events.feed(ToolCallEnd(1, "call_b", "multi_agent_v1__spawn_agent", '{"task": "x"}'))
    out += events.finish("completed", usage=USAGE, completed_at=101)
    sdk_checked(out)
    reasoning, custom, call = draft.output
    assert unseal_reasoning(reasoning["encrypted_content"]) == "Plan."
    assert custom == {"id": "ctc_2", "type": "custom_tool_call", "status": "completed", "call_id": "call_a",
                      "name": "apply_patch", "input": "*** Begin Patch"}
    assert call == {"id": "fc_3", "type": "function_call", "status": "completed", "call_id": "call_b",
                    "name": "spawn_agent", "namespace": "multi_agent_v1", "arguments": '{"task": "x"}'}
    types = [e["type"] for e in out]
    assert "response.custom_tool_call_input.done" in types and "response.function_call_arguments.delta" not in types
