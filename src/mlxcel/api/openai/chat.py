"""POST /v1/chat/completions and /v1/chat/completions/input_tokens (F1, F5): JSON <-> Generation."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from mlxcel.api import chat_prompt
from mlxcel.api.context import ApiContext
from mlxcel.api.errors import ApiError, error_body
from mlxcel.api.generation import ChoiceDelta, ChoiceResult, Generation, LogprobText, Prompt
from mlxcel.api.media import validate_media
from mlxcel.api.openai import common
from mlxcel.api.openai.media import media_refs
from mlxcel.api.openai.schemas import ChatCompletionRequest
from mlxcel.api.replies import JsonReply, Reply, StreamReply
from mlxcel.api.schema import flatten_extra_body, validate_body
from mlxcel.api.sse import DONE_FRAME, sse_frame, with_keepalive


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """Validate a chat body (extra_body fields lifted to the root); raises ApiError(400)."""
    return validate_body(ChatCompletionRequest, flatten_extra_body(body))


async def create_chat_completion(ctx: ApiContext, req: ChatCompletionRequest, headers: Mapping[str, str]) -> Reply:
    """Run a chat completion; a StreamReply when `stream` is true, else the whole JSON reply.

    `headers` (lower-case names) may carry X-Priority. Raises ApiError before any stream starts.
    """
    await validate_media(ctx, media_refs(req))  # C2-C5: resolved and checked first, then refused (text model)
    prompt = render_chat_prompt(ctx, req)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    sampling = common.sampling_params(ctx, req, max_tokens=req.max_completion_tokens or req.max_tokens,
                                      logprobs=logprobs)
    params = common.generation_params(req, sampling, headers)
    completion_id = common.new_id("chatcmpl")
    generation = Generation.start(ctx, [prompt], params, n=req.n, request_id=completion_id)
    if req.stream:
        frames = _stream_frames(ctx, generation, req, completion_id)
        return StreamReply(with_keepalive(frames, ctx.sse_keepalive_s), on_close=generation.aclose)
    results = await generation.collect()
    usage = generation.usage()
    ctx.telemetry.record_completed_request(usage)  # K2: counted the same streamed or not
    return JsonReply({
        "id": completion_id, "object": "chat.completion", "created": common.now(), "model": ctx.model_name,
        "choices": [_choice_json(r, req.logprobs) for r in results], "usage": common.usage_json(usage),
    })


def count_chat_input_tokens(ctx: ApiContext, req: ChatCompletionRequest) -> JsonReply:
    """F5: the prompt token count a chat request would have, without generating."""
    prompt = render_chat_prompt(ctx, req)
    return JsonReply({"object": "chat.completion.input_tokens", "model": ctx.model_name,
                      "input_tokens": len(prompt.token_ids)})


def render_chat_prompt(ctx: ApiContext, req: ChatCompletionRequest) -> Prompt:
    """Render the chat template through the shared renderer (a failure is a 400) and tokenize."""
    messages = chat_prompt.template_messages([m.model_dump(exclude_none=True) for m in req.messages])
    return chat_prompt.render_chat_prompt(
        ctx, messages, tools=req.tools, add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message, template_kwargs=req.chat_template_kwargs)


def _choice_json(result: ChoiceResult, want_logprobs: bool) -> dict[str, Any]:
    return {
        "index": result.index,
        "message": {"role": "assistant", "content": result.text},
        "logprobs": logprobs_json(result.logprobs) if want_logprobs else None,
        "finish_reason": result.finish_reason,
    }


def logprobs_json(entries: Sequence[LogprobText]) -> dict[str, Any]:
    """Chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    def one(e: LogprobText) -> dict[str, Any]:
        return {"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes)}
    return {"content": [{**one(e), "top_logprobs": [one(t) for t in e.top]} for e in entries]}


async def _stream_frames(ctx: ApiContext, generation: Generation, req: ChatCompletionRequest,
                         completion_id: str) -> AsyncIterator[str]:
    created = common.now()
    with_usage = common.include_usage(req)
    base = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name}
    if with_usage:
        base["usage"] = None

    def chunk(choices: list[dict[str, Any]]) -> str:
        return sse_frame({**base, "choices": choices})

    try:
        for index in range(req.n):
            yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        async for delta in generation.stream():
            yield chunk([_delta_json(delta, req.logprobs)])
    except ApiError as exc:  # a failure after the headers went out: an error event, then the end
        yield sse_frame(error_body(exc))
        yield DONE_FRAME
        return
    usage = generation.usage()
    ctx.telemetry.record_completed_request(usage)  # K2: at the end, whether or not usage was asked for
    if with_usage:
        yield sse_frame({**base, "choices": [], "usage": common.usage_json(usage)})
    yield DONE_FRAME


def _delta_json(delta: ChoiceDelta, want_logprobs: bool) -> dict[str, Any]:
    return {
        "index": delta.index,
        "delta": {"content": delta.text} if delta.text else {},
        "logprobs": logprobs_json(delta.logprobs) if want_logprobs and delta.logprobs else None,
        "finish_reason": delta.finish_reason,
    }
