"""POST /v1/messages (E1): Anthropic Messages <-> Generation, streamed or whole.

Any model name maps to the served model, as on the OpenAI routes (clients such as LiteLLM send a
local model's own name, Claude Code a `claude-*` one); the reply echoes the name the client sent. stop_reason: end_turn (end of sequence), max_tokens,
stop_sequence (with `stop_sequence` set), tool_use (a tool call was made). usage reports
Anthropic's split: input_tokens are the prompt tokens not read from the prefix cache,
cache_read_input_tokens the ones that were.

The reply is parsed by the chat features' output parser (reasoning split, the template's tool-call
format): tool calls become tool_use blocks streamed as input_json_delta, reasoning becomes
thinking blocks when the request enables thinking (and is dropped otherwise). Stop sequences
apply to the answer, not to the reasoning.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

from mlxcel.api import chat_features
from mlxcel.api.anthropic.conversation import AnthropicOptions, prepare_prompt
from mlxcel.api.anthropic.schemas import MessagesRequest
from mlxcel.api.anthropic.stream import ContentBlocks, Payload, message_events
from mlxcel.api.context import ApiContext
from mlxcel.api.generation import ChoiceResult, Generation, GenerationParams, failure_error
from mlxcel.api.headers import request_priority
from mlxcel.api.replies import JsonReply, Reply, StreamReply
from mlxcel.api.schema import flatten_extra_body, validate_body
from mlxcel.chat.output import ParsedReply
from mlxcel.chat.plan import ChatPlan
from mlxcel.chat.events import (
    ContentDelta, OutputEvent, ReasoningDelta, ToolCallArguments, ToolCallEnd, ToolCallStart,
)  # fmt: skip
from mlxcel.types import Usage

def parse_messages_request(body: Any) -> MessagesRequest:
    """Validate a Messages body; raises ApiError(400) naming the bad field (D1)."""
    return validate_body(MessagesRequest, flatten_extra_body(body))


async def create_message(ctx: ApiContext, req: MessagesRequest, headers: Mapping[str, str],
                         options: AnthropicOptions) -> Reply:
    """Run one Messages call; raises ApiError (in Anthropic's envelope at the route) before streaming."""
    plan, prompt = await prepare_prompt(ctx, req, options)
    params = GenerationParams(stop=tuple(req.stop_sequences or ()), priority=request_priority(headers))
    params = chat_features.with_chat_features(params, plan)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    generation = Generation.start(ctx, [prompt], params, request_id=message_id)
    shows_thinking = req.shows_thinking
    if req.stream:
        blocks = ContentBlocks()
        start = message_start(message_id, req.model, len(prompt.token_ids))
        body = _stream_body(ctx, generation, blocks, shows_thinking, plan)
        frames = message_events(start, body, ctx.sse_keepalive_s, lambda exc: failure_error(ctx, exc, message_id))
        return StreamReply(frames, on_close=generation.aclose)
    result = (await generation.collect())[0]
    chat_features.remember_replies(plan, [result])
    usage = generation.usage()
    ctx.telemetry.record_completed_request(usage)  # K2: counted like a chat completion
    assert result.reply is not None  # the chat features always parse the reply
    blocks = collected_blocks(result.reply, shows_thinking)
    reason, sequence = stop_reason(result, blocks.has_tool_use)
    return JsonReply(message_json(message_id, req.model, blocks.content(), reason, sequence, usage))


def visible_events(events: Iterable[OutputEvent], shows_thinking: bool) -> list[OutputEvent]:
    """The events that become blocks: reasoning only when the request enabled thinking."""
    return [e for e in events if shows_thinking or not isinstance(e, ReasoningDelta)]


def reply_events(reply: ParsedReply) -> list[OutputEvent]:
    """A whole reply as output events, in block order: thinking, text, tool calls."""
    events: list[OutputEvent] = [ReasoningDelta(reply.reasoning)] if reply.reasoning else []
    if reply.content:
        events.append(ContentDelta(reply.content))
    for call in reply.complete_calls:  # a tool_use cut by max_tokens has no input to show (issue 46)
        events += [ToolCallStart(call.index, call.id, call.name),
                   ToolCallArguments(call.index, call.arguments), ToolCallEnd(call.index, call.id, call.name,
                                                                              call.arguments)]
    return events


def collected_blocks(reply: ParsedReply, shows_thinking: bool) -> ContentBlocks:
    """The blocks of a non-streaming reply, built as the stream builds them."""
    blocks = ContentBlocks()
    for event in visible_events(reply_events(reply), shows_thinking):
        blocks.feed(event)
    blocks.finish()
    return blocks


async def _stream_body(ctx: ApiContext, generation: Generation, blocks: ContentBlocks, shows_thinking: bool,
                       plan: ChatPlan) -> AsyncIterator[Payload]:
    async for delta in generation.stream():
        for event in visible_events(delta.events, shows_thinking):
            for payload in blocks.feed(event):
                yield payload
    for payload in blocks.finish():
        yield payload
    chat_features.remember_replies(plan, generation.results())
    result = generation.results()[0]
    usage = generation.usage()
    ctx.telemetry.record_completed_request(usage)
    reason, sequence = stop_reason(result, blocks.has_tool_use)
    yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
           "usage": usage_json(usage)}
    yield {"type": "message_stop"}


def stop_reason(result: ChoiceResult, has_tool_use: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a finished reply."""
    if has_tool_use and result.finish_reason == "stop":
        return "tool_use", None
    if result.stop is not None:
        return "stop_sequence", result.stop
    if result.finish_reason == "length":
        return "max_tokens", None
    return "end_turn", None


def usage_json(usage: Usage) -> dict[str, int]:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens}


def message_json(message_id: str, model: str, content: list[Payload], reason: str | None, sequence: str | None,
                 usage: Usage) -> Payload:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage_json(usage)}


def message_start(message_id: str, model: str, num_prompt_tokens: int) -> Payload:
    """The opening event: prompt size known, cache use reported at the end (message_delta)."""
    message = message_json(message_id, model, [], None, None, Usage(num_prompt_tokens, 0))
    return {"type": "message_start", "message": message}
