"""llama-server's native reply shapes (F4): the final /completion object, stream chunks, probabilities.

Pure functions from a generation's results to JSON, so the golden tests can pin every field:
`final_json` (the non-streaming reply, and the last stream event with `stop: true`),
`partial_json` (one stream event), `probs_json` (`completion_probabilities`), `timings_json`,
`progress_json` and `progress_timings_json` (a `return_progress` event's `prompt_progress` and `timings`),
and `stream_telemetry`: those fields on a stream event of any protocol that offers them (/completion,
/v1/chat/completions, /v1/completions, /v1/responses).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlxcel.api.generation import ChoiceDelta, ChoiceResult, Generation, LogprobText
from mlxcel.types import PromptProgress


@dataclass(frozen=True, slots=True)
class ReplyOptions:
    """What a request asked about its reply: the echo fields and how much to include."""

    model: str
    id_slot: int
    stream: bool
    return_tokens: bool
    is_prefill_only: bool  # n_predict 0: evaluate the prompt into the cache, generate nothing
    context_size: int
    settings: dict[str, Any]  # generation_settings, as `settings_json` builds it
    is_post_sampling_probs: bool = False  # `prob` / `top_probs` instead of `logprob` / `top_logprobs`
    response_fields: tuple[str, ...] = ()  # when set, the final reply keeps only these "a/b" paths
    timings_per_token: bool = False  # every stream event carries `timings` (llama-server timings_per_token)


def stop_type(result: ChoiceResult) -> str:
    """llama-server's stop_type: "word" (a stop string), "eos", "limit" (n_predict or context), "none"."""
    if result.stop is not None:
        return "word"
    return {"stop": "eos", "length": "limit", "loop": "limit"}.get(result.finish_reason, "none")


def final_json(result: ChoiceResult, prompt_text: str, options: ReplyOptions) -> dict[str, Any]:
    """The completion's summary; in a stream its text and tokens already went out (content "")."""
    kind = "limit" if options.is_prefill_only else stop_type(result)
    text = "" if options.is_prefill_only else result.text
    num_predicted = 0 if options.is_prefill_only else result.num_completion_tokens
    body: dict[str, Any] = {
        "index": result.index,
        "content": "" if options.stream else text,
        "tokens": list(result.token_ids) if options.return_tokens and not options.stream else [],
        "id_slot": options.id_slot,
        "stop": True,
        "model": options.model,
        "tokens_predicted": num_predicted,
        "tokens_evaluated": result.num_prompt_tokens,
        "generation_settings": options.settings,
        "prompt": prompt_text,
        "has_new_line": "\n" in text,
        "truncated": result.finish_reason == "length"
        and result.num_prompt_tokens + num_predicted >= options.context_size,
        "stop_type": kind,
        "stopping_word": result.stop or "",
        "stopped_eos": kind == "eos",
        "stopped_limit": kind == "limit",
        "stopped_word": kind == "word",
        "tokens_cached": result.num_cached_tokens,
        "timings": timings_json(result, num_predicted),
    }
    if not options.stream and result.logprobs and not options.is_prefill_only:
        body["completion_probabilities"] = probs_json(result.logprobs, options.is_post_sampling_probs)
    return select_fields(body, options.response_fields) if options.response_fields else body


def select_fields(body: dict[str, Any], paths: Sequence[str]) -> dict[str, Any]:
    """llama-server's response_fields: {"a/b": body["a"]["b"]} for each path that exists; others are left out."""
    selected: dict[str, Any] = {}
    for path in paths:
        value: Any = body
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            selected[path] = value
    return selected


def partial_json(delta: ChoiceDelta, num_predicted: int, num_prompt_tokens: int, id_slot: int,
                 is_post_sampling: bool = False, telemetry: dict[str, Any] | None = None) -> dict[str, Any]:
    """One stream event: the new text and token ids, `stop: false`, then `telemetry` (`stream_telemetry`:
    `timings`, `prompt_progress`) and the probabilities, in llama-server's order of the fields."""
    body: dict[str, Any] = {
        "index": delta.index, "content": delta.text, "tokens": list(delta.token_ids), "stop": False,
        "id_slot": id_slot, "tokens_predicted": num_predicted, "tokens_evaluated": num_prompt_tokens,
        **(telemetry or {}),
    }
    if delta.logprobs:
        body["completion_probabilities"] = probs_json(delta.logprobs, is_post_sampling)
    return body


def probs_json(entries: Sequence[LogprobText], is_post_sampling: bool = False) -> list[dict[str, Any]]:
    """[{id, token, bytes, logprob, top_logprobs: [{id, token, bytes, logprob}]}] per generated token;
    after the sampler chain (post_sampling_probs) the same with `prob` and `top_probs`."""
    if is_post_sampling:
        return [{**_prob(e), "top_probs": [_prob(t) for t in e.top]} for e in entries]

    def one(entry: LogprobText) -> dict[str, Any]:
        return {"id": entry.token_id, "token": entry.token, "bytes": list(entry.bytes), "logprob": entry.logprob}

    return [{**one(e), "top_logprobs": [one(t) for t in e.top]} for e in entries]


def _prob(entry: LogprobText) -> dict[str, Any]:
    return {"id": entry.token_id, "token": entry.token, "bytes": list(entry.bytes), "prob": math.exp(entry.logprob)}


def timings_json(result: ChoiceResult, num_predicted: int) -> dict[str, Any]:
    """Prefill counts only the prompt tokens not served from the cache (cache_n). The generation
    rate is over decode steps, as llama-server's: the first token comes from the prompt's logits,
    so predicted_ms (first token to last) spans predicted_n - 1 steps. A speculating choice adds
    `draft_n` and `draft_n_accepted`, as llama-server does once a draft was verified."""
    prompt_n = result.num_prompt_tokens - result.num_cached_tokens
    prompt_ms = result.timings.prefill_s * 1000.0
    predicted_ms = result.timings.decode_s * 1000.0
    num_steps = max(num_predicted - 1, 0)
    drafts = {"draft_n": result.num_drafted, "draft_n_accepted": result.num_draft_accepted}
    return {
        "cache_n": result.num_cached_tokens,
        "prompt_n": prompt_n, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": _per_token_ms(prompt_ms, prompt_n),
        "prompt_per_second": _per_second(prompt_ms, prompt_n),
        "predicted_n": num_predicted, "predicted_ms": predicted_ms,
        "predicted_per_token_ms": _per_token_ms(predicted_ms, num_steps),
        "predicted_per_second": _per_second(predicted_ms, num_steps),
        **(drafts if result.num_drafted else {}),
    }


def reply_timings(results: Sequence[ChoiceResult]) -> dict[str, Any]:
    """The `timings` an OpenAI-shaped reply carries beside `usage` (llama-server: its first choice's)."""
    return timings_json(results[0], results[0].num_completion_tokens)


def progress_json(progress: PromptProgress) -> dict[str, int]:
    """`prompt_progress`: {total, cache, processed, time_ms}; processed includes the cached tokens."""
    return {"total": progress.total, "cache": progress.cache, "processed": progress.processed,
            "time_ms": progress.time_ms}


def progress_timings_json(progress: PromptProgress) -> dict[str, Any]:
    """`timings` of a progress event (timings_per_token): the prompt so far, nothing predicted yet;
    the "0 %" event before the first chunk has prompt_n 0 and prompt_ms 0, as llama-server's.

    NOTE: llama-server reports its last finished prompt time here (stale while a prompt runs);
    the elapsed time is the honest one, and every field stays finite."""
    prompt_n = progress.processed - progress.cache
    prompt_ms = float(progress.time_ms) if prompt_n else 0.0
    return {
        "cache_n": progress.cache,
        "prompt_n": prompt_n, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": _per_token_ms(prompt_ms, prompt_n),
        "prompt_per_second": _per_second(prompt_ms, prompt_n),
        "predicted_n": 0, "predicted_ms": 0.0, "predicted_per_token_ms": 0.0, "predicted_per_second": 0.0,
    }


def stream_telemetry(generation: Generation, delta: ChoiceDelta, *, is_timed: bool,
                     num_predicted: int | None = None) -> dict[str, Any]:
    """llama-server's extra fields on a stream event: `timings` when `is_timed` (timings_per_token), then
    `prompt_progress` for a progress delta; empty for a plain delta that is not timed.

    A progress delta is timed with the prompt so far; any other with its choice's timings as they stand,
    `predicted_n` being `num_predicted` when the caller counts the tokens it has sent (else the choice's)."""
    extra: dict[str, Any] = {}
    if is_timed and delta.progress is not None:
        extra["timings"] = progress_timings_json(delta.progress)
    elif is_timed:
        live = generation.snapshot(delta.index)
        extra["timings"] = timings_json(live, live.num_completion_tokens if num_predicted is None else num_predicted)
    if delta.progress is not None:
        extra["prompt_progress"] = progress_json(delta.progress)
    return extra


def _per_token_ms(ms: float, count: int) -> float:
    return ms / count if count else 0.0


def _per_second(ms: float, count: int) -> float:
    return count * 1000.0 / ms if count and ms > 0 else 0.0
