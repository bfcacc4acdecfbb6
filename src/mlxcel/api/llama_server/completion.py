"""llama-server native `POST /completion` and `/completions` (F4): not an alias of /v1/completions.

`prompt` is a string, token ids, a list mixing both (one prompt), or a list of those (several
prompts, answered with an array). Sampling fields keep llama-server's names and defaults;
`logit_bias` takes the array form `[[token or text, bias or false], ...]` and the object form.
A stream is `data: {...}` events (no `[DONE]`); the last one has `stop: true` and the summary.
"""

from __future__ import annotations

import math
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from mlxcel.api import chat_features
from mlxcel.api.chat_options import build_chat_options
from mlxcel.api.context import ApiContext, SamplingDefaults
from mlxcel.api.errors import error_body, invalid_request
from mlxcel.api.generation import Generation, GenerationParams, Prompt, failure_error
from mlxcel.api.headers import request_priority
from mlxcel.api.llama_server.results import ReplyOptions, final_json, partial_json, stream_telemetry
from mlxcel.api.llama_server.schemas import RANDOM_SEED, UINT32_RANDOM_SEED, CompletionFields, CompletionRequest
from mlxcel.api.replies import JsonReply, Reply, StreamReply
from mlxcel.api.schema import flatten_extra_body, lora_pairs, validate_body
from mlxcel.api.sse import sse_frame, with_keepalive
from mlxcel.chat.options import ChatOptions
from mlxcel.text.tokenizer import Tokenizer
from mlxcel.types import SamplingParams


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a /completion body (extra_body fields lifted); raises ApiError(400) naming the bad field."""
    return validate_body(CompletionRequest, flatten_extra_body(body))


async def create_completion(ctx: ApiContext, req: CompletionRequest, headers: Mapping[str, str]) -> Reply:
    """Run /completion: one result object (an array for several prompts), or a native SSE stream."""
    return await run_completion(ctx, completion_prompts(ctx.tokenizer, req.prompt), req, headers)


async def run_completion(ctx: ApiContext, prompts: Sequence[Prompt], fields: CompletionFields,
                         headers: Mapping[str, str]) -> Reply:
    """Generate for `prompts` with `fields` and answer in the native shape (shared with /infill).

    Raises ApiError before any stream starts. Native completions are not counted in the
    request metrics (spec K2 counts chat completions).
    """
    fields = with_server_defaults(fields, ctx.sampling)
    options = completion_options(ctx.tokenizer, fields)
    params = GenerationParams(stop=fields.stop_words, priority=request_priority(headers),
                              cache_prompt=fields.cache_prompt, slot_id=fields.id_slot if fields.id_slot >= 0 else None,
                              lora=lora_pairs(fields.lora), report_progress=fields.stream and fields.return_progress)
    params = chat_features.with_completion_features(ctx, params, options, prompts)
    generation = Generation.start(ctx, prompts, params, request_id=f"cmpl-{uuid.uuid4().hex}")
    reply = reply_options(ctx, fields, options.sampling)
    texts = [prompt_text(ctx.tokenizer, p) for p in prompts]
    if fields.stream:
        frames = _stream_frames(generation, prompts, texts, reply)
        return StreamReply(with_keepalive(frames, ctx.sse_keepalive_s), on_close=generation.aclose)
    results = await generation.collect()
    bodies = [final_json(r, texts[r.prompt_index], reply) for r in results]
    return JsonReply(bodies[0] if len(bodies) == 1 else bodies)


def with_server_defaults(fields: CompletionFields, defaults: SamplingDefaults) -> CompletionFields:
    """`fields` with the sampling defaults (the server's --temp, ..., else the checkpoint's, else llama-server's)
    for the fields the request did not send (a field it sent always wins)."""
    unsent = {name: value for name, value in defaults.values().items() if name not in fields.model_fields_set}
    return fields.model_copy(update=unsent) if unsent else fields


def completion_options(tokenizer: Tokenizer, fields: CompletionFields) -> ChatOptions:
    """The request's options, decided here once: llama-server's sampling fields and the chat
    features' (budget, grammar, loop guard: R, V, P); raises ApiError(400)."""
    max_tokens = fields.num_predict if fields.num_predict >= 0 else None  # R: a budget must fit in n_predict
    return build_chat_options(fields, sampling=sampling_params(tokenizer, fields, max_tokens), max_tokens=max_tokens,
                              output=[("response_format", fields.response_format)])


def reply_options(ctx: ApiContext, fields: CompletionFields, sampling: SamplingParams) -> ReplyOptions:
    return ReplyOptions(model=ctx.model_name, id_slot=fields.id_slot, stream=fields.stream,
                        return_tokens=fields.return_tokens, is_prefill_only=fields.num_predict == 0,
                        context_size=ctx.context_size, settings=settings_json(ctx, fields, sampling),
                        is_post_sampling_probs=fields.post_sampling_probs,
                        response_fields=tuple(fields.response_fields),
                        timings_per_token=fields.timings_per_token)


async def _stream_frames(generation: Generation, prompts: Sequence[Prompt], texts: Sequence[str],
                         options: ReplyOptions) -> AsyncIterator[str]:
    predicted: Counter[int] = Counter()  # choice index == prompt index (one choice per prompt)
    try:
        async for delta in generation.stream():
            i = delta.index
            predicted[i] += len(delta.token_ids)
            is_sent = delta.progress is not None or ((delta.text or delta.token_ids) and not options.is_prefill_only)
            if is_sent:
                telemetry = stream_telemetry(generation, delta, is_timed=options.timings_per_token,
                                             num_predicted=predicted[i])
                yield sse_frame(partial_json(delta, predicted[i], len(prompts[i].token_ids), options.id_slot,
                                             options.is_post_sampling_probs, telemetry))
            if delta.finish_reason is not None:
                yield sse_frame(final_json(generation.results()[i], texts[i], options))
    except Exception as exc:  # noqa: BLE001 - after the headers went out: an error event ends the stream
        yield sse_frame(error_body(failure_error(generation.ctx, exc, generation.request_id)))


# ---- prompts ----

def completion_prompts(tokenizer: Tokenizer, prompt: Any) -> list[Prompt]:
    """llama-server's prompt shapes: a list of only numbers, or numbers and strings, is one prompt."""
    if isinstance(prompt, (str, dict)):
        return [_one_prompt(tokenizer, prompt, "prompt")]
    if not isinstance(prompt, list) or not prompt:
        raise invalid_request("prompt: must be a string, an array of token ids, or a non-empty array of prompts")
    if _is_one_prompt(prompt):
        return [_mixed_prompt(tokenizer, prompt, "prompt")]
    return [_one_prompt(tokenizer, item, f"prompt.{i}") for i, item in enumerate(prompt)]


def _is_token(item: Any) -> bool:
    return isinstance(item, int) and not isinstance(item, bool)


def _is_one_prompt(items: list[Any]) -> bool:
    has_token = any(_is_token(i) for i in items)
    return has_token and all(_is_token(i) or isinstance(i, str) for i in items)


def _one_prompt(tokenizer: Tokenizer, item: Any, where: str) -> Prompt:
    if isinstance(item, str):
        return _checked(tuple(tokenizer.encode(item, add_special_tokens=True)), item, where)
    if isinstance(item, list):
        return _mixed_prompt(tokenizer, item, where)
    if isinstance(item, dict):
        return _object_prompt(tokenizer, item, where)
    raise invalid_request(f"{where}: a prompt must be a string, an array of token ids and strings, or an object")


def _object_prompt(tokenizer: Tokenizer, item: dict[str, Any], where: str) -> Prompt:
    """`{"prompt_string": ..., "multimodal_data": [...]}`; the served model reads text only."""
    if item.get("multimodal_data"):
        raise invalid_request(f"{where}.multimodal_data: the served model does not accept image or audio input")
    text = item.get("prompt_string")
    if not isinstance(text, str):
        raise invalid_request(f"{where}.prompt_string: a string is required")
    return _checked(tuple(tokenizer.encode(text, add_special_tokens=True)), text, where)


def _mixed_prompt(tokenizer: Tokenizer, items: list[Any], where: str) -> Prompt:
    """Token ids as given; strings tokenized in place (BOS only when the list starts with one)."""
    ids: list[int] = []
    for k, item in enumerate(items):
        if _is_token(item):
            ids.append(_checked_id(tokenizer, item, f"{where}.{k}"))
        elif isinstance(item, str):
            ids.extend(tokenizer.encode(item, add_special_tokens=k == 0))
        else:
            raise invalid_request(f"{where}.{k}: expected a token id or a string, not {type(item).__name__}")
    return _checked(tuple(ids), None, where)


def _checked(ids: tuple[int, ...], text: str | None, where: str) -> Prompt:
    if not ids:
        raise invalid_request(f"{where}: the prompt is empty")
    return Prompt(ids, text)


def _checked_id(tokenizer: Tokenizer, token_id: int, where: str) -> int:
    if not 0 <= token_id < tokenizer.num_ids:
        raise invalid_request(f"{where}: token id {token_id} is outside the vocabulary (0..{tokenizer.num_ids - 1})")
    return token_id


def prompt_text(tokenizer: Tokenizer, prompt: Prompt) -> str:
    """The reply's `prompt`: the text as given, or the token ids decoded with their special tokens."""
    return prompt.text if prompt.text is not None else tokenizer.decode(prompt.token_ids)


# ---- sampling ----

def sampling_params(tokenizer: Tokenizer, fields: CompletionFields, max_tokens: int | None) -> SamplingParams:
    """The engine's SamplingParams for llama-server fields and the request's `max_tokens` (from
    n_predict; 0 still samples one token, which the reply drops: the prompt is evaluated into the cache)."""
    return SamplingParams(
        temperature=max(fields.temperature, 0.0), top_k=max(fields.top_k, 0), top_p=fields.top_p,
        min_p=fields.min_p, **fields.sampling_fields(tokenizer),
        repetition_penalty=fields.repeat_penalty, presence_penalty=fields.presence_penalty,
        frequency_penalty=fields.frequency_penalty, repeat_last_n=fields.repeat_last_n,
        logit_bias=logit_bias(tokenizer, fields.logit_bias),
        seed=None if fields.seed in (RANDOM_SEED, UINT32_RANDOM_SEED) else fields.seed,
        max_tokens=None if max_tokens is None else max(max_tokens, 1),
        ignore_eos=fields.ignore_eos, logprobs=fields.n_probs or None,
        is_post_sampling_probs=fields.post_sampling_probs)


def logit_bias(tokenizer: Tokenizer, value: list[Any] | dict[str, Any] | None) -> tuple[tuple[int, float], ...]:
    """`[[id or text, bias or false], ...]` or `{"id or text": bias}`; false bans the token, a text
    biases each of its tokens, true is ignored (as llama-server does)."""
    if not value:
        return ()
    items = list(value.items()) if isinstance(value, dict) else [_pair(p, i) for i, p in enumerate(value)]
    pairs: list[tuple[int, float]] = []
    for where, (key, bias) in zip(_bias_names(value), items):
        amount = _bias_amount(bias, where)
        if amount is not None:
            pairs.extend((token_id, amount) for token_id in _bias_tokens(tokenizer, key, where))
    return tuple(pairs)


def _bias_names(value: list[Any] | dict[str, Any]) -> list[str]:
    keys = value if isinstance(value, dict) else range(len(value))
    return [f"logit_bias.{k}" for k in keys]


def _pair(item: Any, index: int) -> tuple[Any, Any]:
    if not isinstance(item, list) or len(item) != 2:
        raise invalid_request(f"logit_bias.{index}: each entry must be a [token, bias] pair")
    return item[0], item[1]


def _bias_amount(bias: Any, where: str) -> float | None:
    if bias is False:
        return -math.inf
    if bias is True:
        return None
    if isinstance(bias, (int, float)) and math.isfinite(bias):
        return float(bias)
    raise invalid_request(f"{where}: the bias must be a number or false")


def _bias_tokens(tokenizer: Tokenizer, key: Any, where: str) -> list[int]:
    if _is_token(key):
        return [_checked_id(tokenizer, key, where)]
    if isinstance(key, str) and key.lstrip("-").isdigit():
        return [_checked_id(tokenizer, int(key), where)]
    if isinstance(key, str):
        return tokenizer.encode(key, add_special_tokens=False)
    raise invalid_request(f"{where}: the token must be a token id or a text")


def settings_json(ctx: ApiContext, fields: CompletionFields, sampling: SamplingParams) -> dict[str, Any]:
    """`generation_settings`: the options as applied, by llama-server's names."""
    bias = [{"bias": b if math.isfinite(b) else None, "token": t} for t, b in sampling.logit_bias]
    if fields.ignore_eos:  # the sampler suppresses every end-of-generation token: llama-server lists them as -inf
        bias += [{"bias": None, "token": t} for t in sorted(ctx.tokenizer.eos_token_ids)]
    return {
        "n_ctx": ctx.context_size, "n_predict": fields.num_predict, "max_tokens": fields.num_predict,
        "seed": UINT32_RANDOM_SEED if sampling.seed is None else sampling.seed,
        "temperature": fields.temperature, "top_k": fields.top_k, "top_p": fields.top_p, "min_p": fields.min_p,
        **fields.settings(),
        "repeat_last_n": fields.repeat_last_n, "repeat_penalty": fields.repeat_penalty,
        "presence_penalty": fields.presence_penalty, "frequency_penalty": fields.frequency_penalty,
        "stop": list(fields.stop_words), "ignore_eos": fields.ignore_eos, "stream": fields.stream,
        "logit_bias": bias, "n_probs": fields.n_probs, "cache_prompt": fields.cache_prompt,
        # llama-server's adaptive-p sampler is not in mlxcel's chain: its "disabled" values, as applied
        "adaptive_target": -1.0, "adaptive_decay": 0.9,
    }
