"""POST /v1/completions (F1): prompt strings or token ids in, text_completion JSON or SSE out.

llama-server's extensions ride along as on chat: `timings` beside `usage`, and in a stream
`return_progress` (a chunk with empty text and `prompt_progress` per prefill chunk) and
`timings_per_token` (`timings` on every chunk), both from llama_server/results.stream_telemetry.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from mlxcel.api import chat_features
from mlxcel.api.chat_options import build_chat_options
from mlxcel.api.context import ApiContext
from mlxcel.api.errors import ApiError, error_body, invalid_request
from mlxcel.api.generation import ChoiceDelta, ChoiceResult, Generation, LogprobText, Prompt
from mlxcel.api.llama_server.results import reply_timings, stream_telemetry
from mlxcel.api.openai import common
from mlxcel.api.openai.schemas import CompletionRequest
from mlxcel.api.replies import JsonReply, Reply, StreamReply
from mlxcel.api.schema import flatten_extra_body, validate_body
from mlxcel.api.sse import DONE_FRAME, sse_frame, with_keepalive
from mlxcel.chat.options import ChatOptions


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a completions body (extra_body fields lifted to the root); raises ApiError(400)."""
    return validate_body(CompletionRequest, flatten_extra_body(body))


async def create_completion(ctx: ApiContext, req: CompletionRequest, headers: Mapping[str, str]) -> Reply:
    """Run a text completion for one or more prompts, n choices each; raises ApiError before streaming."""
    prompts = completion_prompts(ctx, req.prompt)
    options = completion_options(ctx, req)
    params = chat_features.with_completion_features(ctx, common.generation_params(req, headers), options, prompts)
    completion_id = common.new_id("cmpl")
    generation = Generation.start(ctx, prompts, params, n=req.n, request_id=completion_id)
    if req.stream:
        frames = _stream_frames(ctx, generation, req, prompts, completion_id)
        return StreamReply(with_keepalive(frames, ctx.sse_keepalive_s), on_close=generation.aclose)
    results = await generation.collect()
    usage = generation.usage()
    ctx.telemetry.record_completed_request(usage)  # K2: non-streaming /v1/completions is counted
    choices = [_choice_json(r, req, _prompt_text(ctx, prompts[r.prompt_index]) if req.echo else "")
               for r in results]
    return JsonReply({"id": completion_id, "object": "text_completion", "created": common.now(),
                      "model": ctx.model_name, "system_fingerprint": common.system_fingerprint(),
                      "choices": choices, "usage": common.usage_json(usage), "timings": reply_timings(results)})


def completion_options(ctx: ApiContext, req: CompletionRequest) -> ChatOptions:
    """The request's sampling and its chat features (budget, grammar, loop guard: R, V, P); raises ApiError(400)."""
    sampling = common.sampling_params(ctx, req, max_tokens=req.max_tokens, logprobs=req.logprobs)
    return build_chat_options(req, sampling=sampling, output=[("response_format", req.response_format)])


def completion_prompts(ctx: ApiContext, prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise invalid_request("prompt: must not be empty")
    if isinstance(prompt[0], int):
        return [_token_prompt(ctx, prompt)]  # type: ignore[arg-type]
    if isinstance(prompt[0], str):
        return [Prompt(tuple(ctx.tokenizer.encode(p, add_special_tokens=True)), p) for p in prompt]  # type: ignore[arg-type]
    return [_token_prompt(ctx, ids) for ids in prompt]  # type: ignore[arg-type]


def _token_prompt(ctx: ApiContext, ids: Sequence[int]) -> Prompt:
    if not ids:
        raise invalid_request("prompt: a token-id prompt must not be empty")
    if any(not 0 <= t < ctx.tokenizer.vocab_size for t in ids):
        raise invalid_request(f"prompt: token ids must be between 0 and {ctx.tokenizer.vocab_size - 1}")
    return Prompt(tuple(ids))


def _prompt_text(ctx: ApiContext, prompt: Prompt) -> str:
    return prompt.text if prompt.text is not None else ctx.tokenizer.decode(prompt.token_ids)


def _choice_json(result: ChoiceResult, req: CompletionRequest, prefix: str) -> dict[str, Any]:
    return {
        "index": result.index,
        "text": prefix + result.text,
        "logprobs": logprobs_json(result.logprobs, len(prefix)) if req.logprobs is not None else None,
        "finish_reason": result.finish_reason,
    }


def logprobs_json(entries: Sequence[LogprobText], offset: int) -> dict[str, Any]:
    """Legacy completions logprobs: parallel lists, `text_offset` counted from `offset`."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


async def _stream_frames(ctx: ApiContext, generation: Generation, req: CompletionRequest,
                         prompts: Sequence[Prompt], completion_id: str) -> AsyncIterator[str]:
    base: dict[str, Any] = {"id": completion_id, "object": "text_completion", "created": common.now(),
                            "model": ctx.model_name, "system_fingerprint": common.system_fingerprint()}
    with_usage = common.include_usage(req)
    if with_usage:
        base["usage"] = None
    offsets = [0] * (len(prompts) * req.n)
    try:
        if req.echo:
            for index in range(len(offsets)):
                text = _prompt_text(ctx, prompts[index // req.n])
                offsets[index] = len(text)
                yield sse_frame({**base, "choices": [_chunk_choice(index, text, None, None)]})
        async for delta in generation.stream():
            if delta.progress is not None:  # a prefill chunk: empty text, as llama-server's
                choice = _chunk_choice(delta.index, "", None, None)
            else:
                choice = _delta_json(delta, req, offsets)
            yield sse_frame({**base, "choices": [choice],
                             **stream_telemetry(generation, delta, is_timed=req.timings_per_token)})
    except ApiError as exc:
        yield sse_frame(error_body(exc))
        yield DONE_FRAME
        return
    # K2: streaming /v1/completions is deliberately not counted in requests_total.
    if with_usage:
        yield sse_frame({**base, "choices": [], "usage": common.usage_json(generation.usage()),
                         "timings": reply_timings(generation.results())})
    yield DONE_FRAME


def _delta_json(delta: ChoiceDelta, req: CompletionRequest, offsets: list[int]) -> dict[str, Any]:
    logprobs = None
    if req.logprobs is not None:
        logprobs = logprobs_json(delta.logprobs, offsets[delta.index])
    offsets[delta.index] += sum(len(e.token) for e in delta.logprobs) if delta.logprobs else len(delta.text)
    return _chunk_choice(delta.index, delta.text, logprobs, delta.finish_reason)


def _chunk_choice(index: int, text: str, logprobs: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
