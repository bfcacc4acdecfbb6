"""POST /v1/chat/completions and /v1/chat/completions/input_tokens (F1, F5): JSON <-> Generation.

Chat features (S, R, Q, P, V) come from api/chat_features.py: template kwargs, reasoning split
and echo, reasoning budget, tools and tool_choice, response_format / json_schema / grammar, and
the loop guard; chat_events.py writes the reply's reasoning, content and tool calls. Every
completion is registered in `ctx.controls` while it runs, for live control (F5, control.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from mlxcel.api import chat_features, control
from mlxcel.api.chat_options import build_chat_options
from mlxcel.api.context import ApiContext
from mlxcel.api.errors import error_body
from mlxcel.api.generation import (
    ChoiceDelta, ChoiceResult, Generation, GenerationParams, LogprobText, Prompt, failure_error,
)
from mlxcel.api.llama_server.results import ReplyOptions, final_json, reply_timings, stream_telemetry
from mlxcel.api.llama_server.schemas import UINT32_RANDOM_SEED
from mlxcel.api.media import validate_media, video_marker, with_images
from mlxcel.api.openai import chat_events, common
from mlxcel.api.openai.media import media_refs
from mlxcel.api.openai.messages import template_messages
from mlxcel.api.openai.schemas import ChatCompletionRequest
from mlxcel.api.replies import JsonReply, Reply, StreamReply
from mlxcel.api.schema import flatten_extra_body, validate_body
from mlxcel.api.sse import DONE_FRAME, sse_frame, with_keepalive
from mlxcel.chat.events import ToolCallEnd
from mlxcel.chat.options import ChatOptions
from mlxcel.chat.plan import ChatPlan
from mlxcel.media import MediaKind
from mlxcel.types import SamplingParams


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """Validate a chat body (extra_body fields lifted to the root); raises ApiError(400)."""
    return validate_body(ChatCompletionRequest, flatten_extra_body(body))


def chat_options(req: ChatCompletionRequest, ctx: ApiContext | None = None) -> ChatOptions:
    """The request's options, decided here once: the chat features' (S, R, Q, P, V) and, given the
    context whose vocabulary the token ids are checked against (a completion, not a count), the
    sampling; a count keeps only max_tokens (the budget's bound). Raises ApiError(400)."""
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    sampling = None if ctx is None else common.sampling_params(ctx, req, max_tokens=max_tokens, logprobs=logprobs)
    return build_chat_options(
        req, sampling=sampling, max_tokens=max_tokens, output=[("response_format", req.response_format)],
        tools=req.tools, tool_choice=req.tool_choice, parallel_tool_calls=req.parallel_tool_calls,
        reasoning_effort=req.reasoning_effort, reasoning_control=req.reasoning_control)


async def create_chat_completion(ctx: ApiContext, req: ChatCompletionRequest, headers: Mapping[str, str]) -> Reply:
    """Run a chat completion; a StreamReply when `stream` is true, else the whole JSON reply.

    `headers` (lower-case names) may carry X-Priority. Raises ApiError before any stream starts.
    """
    # C2-C5: resolved and checked first, then refused unless the model takes images (U)
    images = await validate_media(ctx, media_refs(req), takes_images=True)
    params = common.generation_params(req, headers)
    frames = [len(item.frames) for item in images if item.kind is MediaKind.VIDEO]
    plan, prompt = prepare_chat(ctx, req, chat_options(req, ctx), video_frames=frames)
    prompt = await with_images(ctx, prompt, images)
    params = chat_features.with_chat_features(params, plan)
    completion_id = common.new_id("chatcmpl")
    generation = _start_registered(ctx, req, prompt, params, completion_id)
    if req.stream:
        async def close() -> None:
            ctx.controls.unregister(completion_id)
            await generation.aclose()

        frames = _stream_frames(ctx, generation, req, plan, completion_id)
        return StreamReply(with_keepalive(frames, ctx.sse_keepalive_s), on_close=close)
    try:
        results = await generation.collect()
    finally:
        ctx.controls.unregister(completion_id)
    chat_features.remember_replies(plan, results)
    usage = generation.usage()
    ctx.telemetry.record_completed_request(usage)  # K2: counted the same streamed or not
    body = {
        "id": completion_id, "object": "chat.completion", "created": common.now(), "model": ctx.model_name,
        "system_fingerprint": common.system_fingerprint(), "choices": [_choice_json(r, req.logprobs) for r in results],
        "usage": common.usage_json(usage), "timings": reply_timings(results),
    }
    if req.verbose:  # llama-server's debug echo: the native reply, rendered prompt
        body["__verbose"] = _verbose(ctx, prompt, plan.options.sampling, results[0])
    return JsonReply(body)


def _verbose(ctx: ApiContext, prompt: Prompt, sampling: SamplingParams, result: ChoiceResult) -> dict[str, Any]:
    settings = {"n_predict": -1 if sampling.max_tokens is None else sampling.max_tokens,
                "seed": UINT32_RANDOM_SEED if sampling.seed is None else sampling.seed,
                "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                "min_p": sampling.min_p}
    options = ReplyOptions(model=ctx.model_name, id_slot=-1, stream=False, return_tokens=False,
                           is_prefill_only=False, context_size=ctx.context_size, settings=settings)
    text = prompt.text if prompt.text is not None else ctx.tokenizer.decode(prompt.token_ids)
    return final_json(result, text, options)


def _start_registered(ctx: ApiContext, req: ChatCompletionRequest, prompt: Prompt, params: GenerationParams,
                      completion_id: str) -> Generation:
    """Start the choices and register the completion for live control (F5) until it ends; with
    `reasoning_control: true` its choices' budget processors are the control handles."""
    handles: list[control.ReasoningControl] = []
    if req.reasoning_control:
        params, handles = control.collect_handles(params)
    generation = Generation.start(ctx, [prompt], params, n=req.n, request_id=completion_id)
    ctx.controls.register(completion_id, handles, is_opted_in=req.reasoning_control)
    return generation


def count_chat_input_tokens(ctx: ApiContext, req: ChatCompletionRequest) -> JsonReply:
    """F5: the prompt token count a chat request would have, without generating."""
    _, prompt = prepare_chat(ctx, req)
    return JsonReply({"object": "chat.completion.input_tokens", "model": ctx.model_name,
                      "input_tokens": len(prompt.token_ids)})


def prepare_chat(ctx: ApiContext, req: ChatCompletionRequest, options: ChatOptions | None = None, *,
                 video_frames: Sequence[int] = ()) -> tuple[ChatPlan, Prompt]:
    """The request's chat plan and its rendered prompt (a failure of either is a 400); `options`
    default to a count's (`chat_options(req)`); `video_frames`: each video part's sampled frame count."""
    options = options or chat_options(req)
    messages = template_messages([m.model_dump(exclude_none=True) for m in req.messages], ctx.image_marker,
                                 video_frames, video_marker(ctx))
    plan = chat_features.plan_chat(ctx, options, messages)
    prompt = chat_features.render_plan(ctx, plan, add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message)
    return plan, prompt


def render_chat_prompt(ctx: ApiContext, req: ChatCompletionRequest) -> Prompt:
    """The prompt the request generates from (template kwargs and reasoning echo applied)."""
    return prepare_chat(ctx, req)[1]


def _choice_json(result: ChoiceResult, want_logprobs: bool) -> dict[str, Any]:
    assert result.reply is not None  # chat generations always parse their output
    return {
        "index": result.index,
        "message": chat_events.message_json(result.reply),
        "logprobs": logprobs_json(result.logprobs) if want_logprobs else None,
        "finish_reason": chat_events.finish_reason(result.finish_reason, bool(result.reply.complete_calls)),
    }


def logprobs_json(entries: Sequence[LogprobText]) -> dict[str, Any]:
    """Chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    def one(e: LogprobText) -> dict[str, Any]:
        return {"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes)}
    return {"content": [{**one(e), "top_logprobs": [one(t) for t in e.top]} for e in entries]}


async def _stream_frames(ctx: ApiContext, generation: Generation, req: ChatCompletionRequest, plan: ChatPlan,
                         completion_id: str) -> AsyncIterator[str]:
    created = common.now()
    with_usage = common.include_usage(req)
    base = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name,
            "system_fingerprint": common.system_fingerprint()}
    if with_usage:
        base["usage"] = None

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse_frame({**base, "choices": choices, **extra})

    try:
        for index in range(req.n):
            yield chunk([_role_choice(index)])
        called: set[int] = set()  # choices that made tool calls
        async for delta in generation.stream():
            if delta.progress is not None:
                yield chunk([_role_choice(delta.index)], **stream_telemetry(generation, delta,
                                                                            is_timed=req.timings_per_token))
                continue
            choices = _delta_choices(delta, req.logprobs, called)
            for k, choice in enumerate(choices):
                is_last = k == len(choices) - 1  # llama-server: telemetry on a step's last chunk
                yield chunk([choice], **(stream_telemetry(generation, delta, is_timed=req.timings_per_token)
                                         if is_last else {}))
    except Exception as exc:  # noqa: BLE001 - a failure after the headers went out: an error event, then the end
        yield sse_frame(error_body(failure_error(ctx, exc, completion_id)))
        yield DONE_FRAME
        return
    finally:
        ctx.controls.unregister(completion_id)  # generation over: control answers "no active completion"
    chat_features.remember_replies(plan, generation.results())
    usage = generation.usage()
    ctx.telemetry.record_completed_request(usage)  # K2: at the end, whether or not usage was asked for
    if with_usage:
        yield sse_frame({**base, "choices": [], "usage": common.usage_json(usage),
                         "timings": reply_timings(generation.results())})
    yield DONE_FRAME


def _role_choice(index: int) -> dict[str, Any]:
    """The role chunk's choice; content null, as llama-server sends it: a delta's content is never ""."""
    return {"index": index, "delta": {"role": "assistant", "content": None}, "logprobs": None, "finish_reason": None}


def _delta_choices(delta: ChoiceDelta, want_logprobs: bool, called: set[int]) -> list[dict[str, Any]]:
    """One chunk choice per output event; logprobs ride on the first, the finish reason on the last."""
    if any(isinstance(e, ToolCallEnd) and e.is_complete for e in delta.events):
        called.add(delta.index)  # a call the token limit cut is no reason to say "tool_calls"
    logprobs = logprobs_json(delta.logprobs) if want_logprobs and delta.logprobs else None
    deltas = chat_events.event_deltas(delta.events)
    if not deltas and logprobs is None and delta.finish_reason is None:
        return []
    choices = [{"index": delta.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas or [{}]]
    choices[0]["logprobs"] = logprobs
    if delta.finish_reason is not None:
        choices[-1]["finish_reason"] = chat_events.finish_reason(delta.finish_reason, delta.index in called)
    return choices
