"""POST /v1/completions (F1): prompt strings or token ids in, text_completion JSON or SSE out.

llama-server's extensions ride along as on chat: `timings` beside `usage`, and in a stream
`return_progress` (a chunk with empty text and `prompt_progress` per prefill chunk) and
`timings_per_token` (`timings` on every chunk), both from llama_server/results.stream_telemetry.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from mlxcel.api import chat_features
from mlxcel.api.chat_options import build_chat_options
from mlxcel.api.context import ApiContext
from mlxcel.api.errors import error_body, invalid_request
from mlxcel.api.generation import (
    ChoiceDelta, ChoiceResult, Generation, LogprobText, Prompt, PromptLogprobs, PromptLogprobText, failure_error,
)
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
    sampling = replace(sampling, prompt_logprobs=prompt_logprobs_wanted(req))
    return build_chat_options(req, sampling=sampling, output=[("response_format", req.response_format)])


def prompt_logprobs_wanted(req: CompletionRequest) -> int | None:
    """How many alternatives each prompt token needs: vLLM's `prompt_logprobs`, or OpenAI's legacy `echo`
    with `logprobs` N (the echoed prompt's tokens carry logprobs too; lm-eval's loglikelihood relies on it)."""
    echoed = req.logprobs if req.echo and req.logprobs is not None else None
    wanted = [n for n in (req.prompt_logprobs, echoed) if n is not None]
    return max(wanted) if wanted else None


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
    if any(not 0 <= t < ctx.tokenizer.num_ids for t in ids):
        raise invalid_request(f"prompt: token ids must be between 0 and {ctx.tokenizer.num_ids - 1}")
    return Prompt(tuple(ids))


def _prompt_text(ctx: ApiContext, prompt: Prompt) -> str:
    return prompt.text if prompt.text is not None else ctx.tokenizer.decode(prompt.token_ids)


def _choice_json(result: ChoiceResult, req: CompletionRequest, prefix: str) -> dict[str, Any]:
    choice = {
        "index": result.index,
        "text": prefix + result.text,
        "logprobs": _logprobs(result.logprobs, result.prompt_logprobs, req, len(prefix)),
        "finish_reason": result.finish_reason,
    }
    if req.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(result.prompt_logprobs)
    return choice


def _logprobs(entries: Sequence[LogprobText], prompt: PromptLogprobs | None, req: CompletionRequest,
              offset: int) -> dict[str, Any] | None:
    """The legacy `logprobs` object; with `echo` it starts with the prompt's tokens (the first one's
    logprob and alternatives null), as OpenAI's legacy API and vLLM answer."""
    if req.logprobs is None:
        return None
    if not req.echo or prompt is None:
        return logprobs_json(entries, offset)
    head = _prompt_logprobs_json(prompt, req.logprobs)
    tail = logprobs_json(entries, sum(len(t) for t in head["tokens"]))
    return {key: head[key] + tail[key] for key in head}


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


def _prompt_logprobs_json(prompt: PromptLogprobs, num_top: int) -> dict[str, Any]:
    """The prompt's part of the legacy object, from text offset 0; a token's `top_logprobs` holds its
    N best alternatives and the token itself (vLLM's shape: up to N + 1 entries)."""
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for item in prompt:
        e = item.entry
        values.append(e.logprob if e is not None else None)  # the first token has no context: null
        tops.append({**{t.token: t.logprob for t in e.top[:num_top]}, e.token: e.logprob} if e is not None else None)
        offsets.append(offset)
        offset += len(item.token.token)
    return {"tokens": [item.token.token for item in prompt], "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def vllm_prompt_logprobs(prompt: PromptLogprobs | None) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token {token id: {logprob, rank, decoded_token}} for the token
    and its N best alternatives; null for the first token."""
    if prompt is None:
        return None
    return [_vllm_position(item) if item.entry is not None else None for item in prompt]


def _vllm_position(item: PromptLogprobText) -> dict[str, dict[str, Any]]:
    e = item.entry
    assert e is not None
    position = {str(t.token_id): {"logprob": t.logprob, "rank": rank, "decoded_token": t.token}
                for rank, t in enumerate(e.top, start=1)}
    position[str(e.token_id)] = {"logprob": e.logprob, "rank": item.rank, "decoded_token": e.token}
    return position


async def _stream_frames(ctx: ApiContext, generation: Generation, req: CompletionRequest,
                         prompts: Sequence[Prompt], completion_id: str) -> AsyncIterator[str]:
    base: dict[str, Any] = {"id": completion_id, "object": "text_completion", "created": common.now(),
                            "model": ctx.model_name, "system_fingerprint": common.system_fingerprint()}
    with_usage = common.include_usage(req)
    if with_usage:
        base["usage"] = None
    offsets = [0] * (len(prompts) * req.n)
    # With logprobs, an echoed prompt waits for its logprobs, which come with the choice's first delta.
    is_echo_late = req.echo and req.logprobs is not None
    try:
        if req.echo and not is_echo_late:
            for index in range(len(offsets)):
                text = _prompt_text(ctx, prompts[index // req.n])
                offsets[index] = len(text)
                yield sse_frame({**base, "choices": [_chunk_choice(index, text, None, None)]})
        async for delta in generation.stream():
            if delta.prompt_logprobs is not None and (is_echo_late or req.prompt_logprobs is not None):
                text = _prompt_text(ctx, prompts[delta.index // req.n]) if is_echo_late else ""
                yield sse_frame({**base, "choices": [_prompt_chunk(delta, text, req, offsets)]})
            if delta.progress is not None:  # a prefill chunk: empty text, as llama-server's
                choice = _chunk_choice(delta.index, "", None, None)
            else:
                choice = _delta_json(delta, req, offsets)
            yield sse_frame({**base, "choices": [choice],
                             **stream_telemetry(generation, delta, is_timed=req.timings_per_token)})
    except Exception as exc:  # noqa: BLE001 - issue 44: this request's error event, then the end
        yield sse_frame(error_body(failure_error(ctx, exc, completion_id)))
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


def _prompt_chunk(delta: ChoiceDelta, text: str, req: CompletionRequest, offsets: list[int]) -> dict[str, Any]:
    """A choice's echoed prompt with its logprobs (echo), and vLLM's `prompt_logprobs` when asked."""
    assert delta.prompt_logprobs is not None
    logprobs = None
    if req.echo and req.logprobs is not None:
        logprobs = _prompt_logprobs_json(delta.prompt_logprobs, req.logprobs)
        offsets[delta.index] = sum(len(t) for t in logprobs["tokens"])
    choice = _chunk_choice(delta.index, text, logprobs, None)
    if req.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(delta.prompt_logprobs)
    return choice


def _chunk_choice(index: int, text: str, logprobs: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
