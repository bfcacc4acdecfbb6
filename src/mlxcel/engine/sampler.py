"""Next-token selection for a batch of rows, each with its own SamplingParams.

Logits processors are small functions applied in llama.cpp's order: bias, penalties,
min_tokens, then temperature and the truncations (top_k, top_p, min_p). A row with a
seed draws from its own generator, so its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mlxcel.types import SamplingParams, TokenLogprob, TokenProcessor


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one request at this step."""

    params: SamplingParams
    history: Sequence[int]  # prompt + generated tokens (penalty window source)
    num_generated: int
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None = None
    processors: tuple[TokenProcessor, ...] = ()


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [num_rows, vocab] float32 on any device -> one token id per row (+ logprobs where asked).

    Plain greedy rows take their argmax where the logits are (on a GPU only the ids cross to the
    host); every other chain runs on the host, where the rows' seeded generators live."""
    if all(_is_plain_greedy(r) for r in rows):
        return logits.argmax(dim=-1).tolist(), [None] * len(rows)
    logits = logits.cpu()
    tokens: list[int] = []
    logprobs: list[TokenLogprob | None] = []
    for i, row in enumerate(rows):
        token, final = _sample_row(logits[i], row)
        tokens.append(token)
        if row.params.is_post_sampling_probs:
            logprobs.append(_post_sampling_logprob(final, token, row.params.logprobs))
        else:
            logprobs.append(_logprob(logits[i], token, row.params.logprobs))
    return tokens, logprobs


def _is_plain_greedy(row: SamplingRow) -> bool:
    p = row.params
    return (p.is_greedy and p.logprobs is None and not row.processors and not p.logit_bias and p.min_tokens <= row.num_generated
            and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and (p.ignore_eos is False or not row.eos_token_ids))


def _sample_row(logits: torch.Tensor, row: SamplingRow) -> tuple[int, torch.Tensor | None]:
    """The chosen token, and the logits it was drawn from after the whole chain (None: greedy)."""
    p = row.params
    logits = logits.clone()
    apply_logit_bias(logits, p.logit_bias)
    apply_penalties(logits, row)
    output_ids = row.history[len(row.history) - row.num_generated:]
    for processor in row.processors:
        processor.process(logits, output_ids)
    if p.ignore_eos or row.num_generated < p.min_tokens:
        suppress(logits, row.eos_token_ids | set(p.stop_token_ids))
    if p.is_greedy:
        return int(logits.argmax()), None
    logits = logits / p.temperature
    logits = top_k_filter(logits, p.top_k)
    logits = top_p_filter(logits, p.top_p)
    logits = min_p_filter(logits, p.min_p)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=row.generator)), logits


def apply_logit_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> None:
    for token_id, value in bias:
        if 0 <= token_id < logits.shape[-1]:
            logits[token_id] += value


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    p = row.params
    if p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
        return
    window = _penalty_window(row.history, p.repeat_last_n)
    if not window:
        return
    ids, counts = torch.tensor(window).unique(return_counts=True)
    chosen = logits[ids]
    if p.repetition_penalty != 1.0:  # CTRL-style: shrink positive scores, grow negative ones
        chosen = torch.where(chosen > 0, chosen / p.repetition_penalty, chosen * p.repetition_penalty)
    chosen = chosen - counts.to(chosen.dtype) * p.frequency_penalty - p.presence_penalty
    logits[ids] = chosen


def _penalty_window(history: Sequence[int], repeat_last_n: int) -> Sequence[int]:
    if repeat_last_n == 0:
        return ()
    return history if repeat_last_n < 0 else history[-repeat_last_n:]


def suppress(logits: torch.Tensor, token_ids: set[int] | frozenset[int]) -> None:
    valid = [t for t in token_ids if 0 <= t < logits.shape[-1]]
    if valid:
        logits[valid] = float("-inf")


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    threshold = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    # Keep the smallest set whose mass reaches top_p (the first token always stays).
    remove = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
    return logits.masked_fill(torch.zeros_like(remove).scatter(0, order, remove), float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def _post_sampling_logprob(final: torch.Tensor | None, token: int, num_top: int | None) -> TokenLogprob | None:
    """Log-probabilities of the distribution the token was drawn from (after top-k/p, min-p and
    temperature); tokens the chain removed are left out. Greedy: the chosen token, probability 1."""
    if num_top is None:
        return None
    if final is None:
        return TokenLogprob(token_id=token, logprob=0.0, top=((token, 0.0),) if num_top > 0 else ())
    logprobs = torch.log_softmax(final.float(), dim=-1)
    num_kept = int(torch.isfinite(logprobs).sum())
    top: tuple[tuple[int, float], ...] = ()
    if num_top > 0 and num_kept:
        values, ids = torch.topk(logprobs, min(num_top, num_kept))
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token_id=token, logprob=float(logprobs[token]), top=top)


def _logprob(logits: torch.Tensor, token: int, num_top: int | None) -> TokenLogprob | None:
    if num_top is None:
        return None
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if num_top > 0:
        values, ids = torch.topk(logprobs, num_top)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token_id=token, logprob=float(logprobs[token]), top=top)


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator
