"""POST /v1/messages (E1): Anthropic Messages <-> Generation, streamed or whole.

Any `claude-*` model name (and the served model's own name) maps to the served model; the
reply echoes the name the client sent. stop_reason: end_turn (end of sequence), max_tokens,
stop_sequence (with `stop_sequence` set), tool_use (a tool call was made). usage reports
Anthropic's split: input_tokens are the prompt tokens not read from the prefix cache,
cache_read_input_tokens the ones that were.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from mlxcel.api.anthropic.conversation import AnthropicOptions, render_prompt
from mlxcel.api.anthropic.schemas import MessagesRequest
from mlxcel.api.anthropic.stream import ContentBlocks, Payload, message_events
from mlxcel.api.context import ApiContext
from mlxcel.api.errors import ApiError
from mlxcel.api.generation import ChoiceResult, Generation, GenerationParams
from mlxcel.api.headers import request_priority
from mlxcel.api.replies import JsonReply, Reply, StreamReply
from mlxcel.api.schema import validate_body
from mlxcel.text.events import ContentDelta, OutputEvent
from mlxcel.types import SamplingParams, Usage

CLAUDE_PREFIX = "claude-"
DEFAULT_TEMPERATURE = 1.0  # Anthropic's default


class OutputParser(Protocol):
    """Splits reply text into output events; text/chat_output.ChatOutputParser fits here."""

    def feed(self, text: str) -> list[OutputEvent]: ...

    def finish(self) -> list[OutputEvent]: ...


class PlainText:
    """The reply is all answer text (no reasoning split or tool-call parsing for this request)."""

    def feed(self, text: str) -> list[OutputEvent]:
        return [ContentDelta(text)] if text else []

    def finish(self) -> list[OutputEvent]:
        return []


def parse_messages_request(body: Any) -> MessagesRequest:
    """Validate a Messages body; raises ApiError(400) naming the bad field (D1)."""
    return validate_body(MessagesRequest, body)


def check_model(ctx: ApiContext, model: str) -> None:
    """Any claude-* name, or the served model's own name; anything else is a 404."""
    if model == ctx.model_name or model.startswith(CLAUDE_PREFIX):
        return
    raise ApiError(404, f"model: {model!r} is not served here; use {ctx.model_name!r} or any claude-* name",
                   "not_found_error", code=404)


async def create_message(ctx: ApiContext, req: MessagesRequest, headers: Mapping[str, str],
                         options: AnthropicOptions) -> Reply:
    """Run one Messages call; raises ApiError (in Anthropic's envelope at the route) before streaming."""
    check_model(ctx, req.model)
    prompt = await render_prompt(ctx, req, options)
    params = GenerationParams(sampling=sampling_params(req), stop=tuple(req.stop_sequences or ()),
                              priority=request_priority(headers))
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    generation = Generation.start(ctx, [prompt], params, request_id=message_id)
    parser = output_parser(req)
    if req.stream:
        blocks = ContentBlocks()
        start = message_start(message_id, req.model, len(prompt.token_ids))
        frames = message_events(start, blocks, _stream_body(ctx, generation, blocks, parser), ctx.sse_keepalive_s)
        return StreamReply(frames, on_close=generation.aclose)
    result = (await generation.collect())[0]
    usage = generation.usage()
    ctx.telemetry.record_completed_request(usage)  # K2: counted like a chat completion
    blocks = collected_blocks(result.text, parser)
    reason, sequence = stop_reason(result, blocks.has_tool_use)
    return JsonReply(message_json(message_id, req.model, blocks.content(), reason, sequence, usage))


def output_parser(req: MessagesRequest) -> OutputParser:
    """Where reasoning and tool-call parsing plug in (the chat features' output parser)."""
    return PlainText()


def sampling_params(req: MessagesRequest) -> SamplingParams:
    return SamplingParams(temperature=DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
                          top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                          max_tokens=req.max_tokens)


def collected_blocks(text: str, parser: OutputParser) -> ContentBlocks:
    blocks = ContentBlocks()
    blocks.open_text()
    for event in [*parser.feed(text), *parser.finish()]:
        blocks.feed(event)
    blocks.close()
    return blocks


async def _stream_body(ctx: ApiContext, generation: Generation, blocks: ContentBlocks,
                       parser: OutputParser) -> AsyncIterator[Payload]:
    async for delta in generation.stream():
        for event in parser.feed(delta.text):
            for payload in blocks.feed(event):
                yield payload
    for event in parser.finish():
        for payload in blocks.feed(event):
            yield payload
    for payload in blocks.close():
        yield payload
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
