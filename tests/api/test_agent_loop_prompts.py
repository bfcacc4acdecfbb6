"""The agent loop's second turn (tool call, then its result) rendered by SmolLM2's real template,
which knows nothing of tools, on all three chat protocols and /apply-template: each prompt must
carry the call in llama-server's generic JSON form and the result (the OpenAI SDK's
`"content": null` assistant message included)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from mlxcel.api.anthropic.conversation import AnthropicOptions, prepare_prompt
from mlxcel.api.anthropic.messages import parse_messages_request
from mlxcel.api.context import ApiContext
from mlxcel.api.llama_server.template import apply_template, parse_apply_template_request
from mlxcel.api.openai.chat import parse_chat_request, prepare_chat
from mlxcel.api.responses.create import parse_create_request
from mlxcel.api.responses.items import stored_items
from mlxcel.api.responses.prompt import render_prompt
from mlxcel.api.responses.schemas import parse_input_items
from mlxcel.text.tokenizer import Tokenizer

from .scripted_engine import ScriptedEngine, scripted_context, smollm2_metadata

ARGUMENTS = {"city": "Paris"}
QUESTION = "What is the weather in Paris?"
RESULT = "Sunny, 21 C"
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OPENAI_LOOP = [
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
]


@pytest.fixture(scope="module")
def ctx() -> ApiContext:
    metadata = smollm2_metadata()
    return scripted_context(Tokenizer.from_gguf(metadata), ScriptedEngine([]), metadata)


def assert_loop_rendered(prompt: str) -> None:
    assert "<tool_call>" not in prompt  # SmolLM2's template has no tool syntax of its own
    assert '"get_weather"' in prompt and '"Paris"' in prompt  # the call, as generic JSON
    assert RESULT in prompt
    assert prompt.index('"get_weather"') < prompt.index(RESULT)  # call before result, in turn order


def test_openai_content_null_tool_call_then_result(ctx: ApiContext) -> None:
    req = parse_chat_request({"messages": OPENAI_LOOP, "tools": [
        {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}]})
    _, prompt = prepare_chat(ctx, req)
    assert_loop_rendered(prompt.text or "")


def test_apply_template_content_null_tool_call_then_result(ctx: ApiContext) -> None:
    reply = apply_template(ctx, parse_apply_template_request({"messages": OPENAI_LOOP}))
    assert_loop_rendered(reply.body["prompt"])


def test_anthropic_tool_use_then_tool_result(ctx: ApiContext) -> None:
    body: dict[str, Any] = {"model": "claude-test", "max_tokens": 8, "tools": [
        {"name": "get_weather", "input_schema": PARAMETERS}], "messages": [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": ARGUMENTS}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT}]}]}
    _, prompt = asyncio.run(prepare_prompt(ctx, parse_messages_request(body), AnthropicOptions()))
    assert_loop_rendered(prompt.text or "")


def test_responses_function_call_then_output(ctx: ApiContext) -> None:
    loop = [{"role": "user", "content": QUESTION},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": json.dumps(ARGUMENTS)},
            {"type": "function_call_output", "call_id": "c1", "output": RESULT}]
    req = parse_create_request({"input": loop, "tools": [
        {"type": "function", "name": "get_weather", "parameters": PARAMETERS}]})
    prompt = render_prompt(ctx, req, stored_items(parse_input_items(loop)))
    assert_loop_rendered(prompt.text or "")
