"""Mirostat 1 and 2 (llama-server's `mirostat`, `mirostat_tau`, `mirostat_eta`): a per-request token processor.

Mirostat keeps each token's surprise (-log2 of its probability) near `tau` by a running bound `mu` (2 tau at the
start): version 2 removes the tokens more surprising than `mu`; version 1 estimates the distribution's Zipf
exponent from its best 100 tokens and keeps the top k that bound implies. After each token `mu` moves by `eta`
times the error of the observed surprise. As in llama.cpp, mirostat replaces top-k, top-p, min-p, the other
truncations, the penalties and DRY (`with_mirostat` turns them off): temperature, then mirostat, then the draw.

The processor truncates the row's logits before the sampler's temperature and draw (which then draw from the
survivors' tempered softmax, llama.cpp's distribution), and reads the drawn token's surprise in `accept`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch

from mlxcel.types import FinishReason, Request, SamplingParams

_ZIPF_TOKENS = 100  # llama.cpp's m: the best tokens version 1 fits its exponent on


def with_mirostat(request: Request) -> Request:
    """The request as the engine runs it: with mirostat on, its own Mirostat processor, and the truncations,
    penalties and DRY off (llama.cpp's chain with mirostat is logit bias, temperature and mirostat alone)."""
    sampling = request.sampling
    if not sampling.mirostat:
        return request
    sampling = replace(sampling, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, xtc_probability=0.0,
                       top_n_sigma=-1.0, dynatemp_range=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                       frequency_penalty=0.0, dry_multiplier=0.0)
    return replace(request, sampling=sampling, processors=(*request.processors, Mirostat(sampling)))


class Mirostat:
    """One request's mirostat state (a `TokenProcessor`)."""

    def __init__(self, params: SamplingParams) -> None:
        self.version, self.tau, self.eta = params.mirostat, params.mirostat_tau, params.mirostat_eta
        self.temperature = params.temperature
        self.mu = 2.0 * self.tau
        self._log_probs: torch.Tensor | None = None  # the survivors' tempered log-probabilities, for `accept`

    def process(self, logits: torch.Tensor, output_ids: Sequence[int]) -> None:
        if self.temperature <= 0.0:
            return  # greedy: the best token is always kept, nothing to steer
        log_probs = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        remove = self._removed_v2(log_probs) if self.version == 2 else self._removed_v1(log_probs)
        logits.masked_fill_(remove, float("-inf"))
        self._log_probs = torch.log_softmax(log_probs.masked_fill(remove, float("-inf")), dim=-1)

    def accept(self, token_id: int) -> FinishReason | None:
        if self._log_probs is not None:
            surprise = -self._log_probs[token_id].item() / math.log(2.0)
            if math.isfinite(surprise):
                self.mu -= self.eta * (surprise - self.tau)
            self._log_probs = None
        return None

    def _removed_v2(self, log_probs: torch.Tensor) -> torch.Tensor:
        remove = -log_probs / math.log(2.0) > self.mu
        remove[log_probs.argmax()] = False  # at least the best token stays
        return remove

    def _removed_v1(self, log_probs: torch.Tensor) -> torch.Tensor:
        vocab = log_probs.shape[-1]
        best = torch.topk(log_probs, min(_ZIPF_TOKENS, vocab)).values.double()
        ranks = torch.arange(1, best.shape[0], dtype=torch.float64)
        t = torch.log((ranks + 1) / ranks)  # log((i + 2) / (i + 1)) for i from 0
        b = (best[:-1] - best[1:]).clamp(max=1e4)  # log(p_i / p_(i+1)); a removed token's step stays finite
        s_hat = float((t * b).sum() / (t * t).sum()) if len(t) else 1.0
        epsilon = s_hat - 1.0
        try:
            k = (epsilon * 2.0 ** self.mu / (1.0 - vocab ** -epsilon)) ** (1.0 / s_hat)
        except (OverflowError, ZeroDivisionError):
            k = float(vocab)
        k = vocab if not isinstance(k, float) or not math.isfinite(k) else min(max(int(k), 1), vocab)
        remove = torch.ones_like(log_probs, dtype=torch.bool)
        remove[torch.topk(log_probs, k).indices] = False
        return remove
