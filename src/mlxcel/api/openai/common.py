"""Pieces shared by the OpenAI chat and completions adapters: request fields to engine params, usage.

`sampling_params` is the request's `SamplingParams` (which its adapter puts into the
`ChatOptions`); `generation_params` the rest of its `GenerationParams` (stop strings, priority,
slot, LoRA), to which the chat features add the options' sampling, processors and parser.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from mlxcel.api.context import ApiContext
from mlxcel.api.errors import invalid_request
from mlxcel.api.generation import GenerationParams
from mlxcel.api.openai.schemas import SamplingFields
from mlxcel.api.schema import lora_pairs
from mlxcel.types import Priority, SamplingParams, Usage

PRIORITY_HEADER = "x-priority"


@functools.cache
def system_fingerprint() -> str:
    """The backend build a reply came from, in llama-server's `b<build>-<commit>` shape."""
    try:
        return f"b{version('mlxcel')}-mlxcel"
    except PackageNotFoundError:
        return "b0-mlxcel"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def logit_bias(ctx: ApiContext, bias: Mapping[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id as string": bias}; ids must be in the vocabulary, bias in [-100, 100]."""
    if not bias:
        return ()
    pairs = []
    for key, value in bias.items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < ctx.tokenizer.num_ids:
            raise invalid_request(f"logit_bias: {key!r} is not a token id of this model")
        if not -100.0 <= value <= 100.0:
            raise invalid_request(f"logit_bias[{key}]: {value} is outside [-100, 100]")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def sampling_params(ctx: ApiContext, req: SamplingFields, *, max_tokens: int | None,
                    logprobs: int | None) -> SamplingParams:
    """The engine's SamplingParams for an OpenAI request (top_k -1 and 0 both mean off)."""
    stop_ids = tuple(req.stop_token_ids or ())
    if any(not 0 <= t < ctx.tokenizer.num_ids for t in stop_ids):
        raise invalid_request("stop_token_ids: every id must be a token id of this model")
    server = ctx.sampling  # server flags, checkpoint, llama-server: for the fields the request leaves out
    return SamplingParams(
        temperature=server.pick("temperature", req.temperature),
        top_k=max(server.pick("top_k", req.top_k), 0),
        top_p=server.pick("top_p", req.top_p),
        min_p=server.pick("min_p", req.min_p),
        **req.sampling_fields(ctx.tokenizer),
        repetition_penalty=server.pick("repeat_penalty", req.repetition_penalty or req.repeat_penalty),
        presence_penalty=server.pick("presence_penalty", req.presence_penalty),
        frequency_penalty=server.pick("frequency_penalty", req.frequency_penalty),
        repeat_last_n=server.pick("repeat_last_n", req.repeat_last_n),
        logit_bias=logit_bias(ctx, req.logit_bias),
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop_token_ids=stop_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
    )


def parse_priority(headers: Mapping[str, str]) -> Priority:
    """X-Priority: high | normal | low (spec L); anything else is a 400."""
    try:
        return Priority.parse(headers.get(PRIORITY_HEADER))
    except ValueError as exc:
        raise invalid_request(f"X-Priority: {exc}") from None


def generation_params(req: SamplingFields, headers: Mapping[str, str]) -> GenerationParams:
    """Stop strings, scheduling (X-Priority, slot, prompt cache) and LoRA; the sampling comes with the
    chat features (api/chat_features.py), from the request's `ChatOptions`."""
    slot = req.id_slot if req.id_slot is not None and req.id_slot >= 0 else None
    return GenerationParams(stop=stop_strings(req.stop), priority=parse_priority(headers),
                            cache_prompt=req.cache_prompt, slot_id=slot,
                            skip_special_tokens=req.skip_special_tokens, lora=lora_pairs(req.lora),
                            report_progress=req.stream and req.return_progress)


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def include_usage(req: SamplingFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)
