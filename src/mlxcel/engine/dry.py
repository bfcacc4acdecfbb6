"""DRY, "don't repeat yourself" (llama-server's `dry_*` fields): a per-request token processor.

A token that would extend a stretch of the recent context repeating an earlier stretch is penalized by
`multiplier * base ** (length - allowed_length)`, where length is the longest such repeat it extends (at least
`allowed_length`). Sequence breakers (newline, ':', '"', '*' by default) end a repeat: no match reaches back
past the last one in the context, and a token that is a breaker by itself is never penalized. As in
llama.cpp the repeats are found with the Z-algorithm over the last `penalty_last_n` tokens (prompt and
output), and a breaker may span tokens: `breakers` maps a head token to the token tails that complete it
(the API works them out from the strings and the vocabulary: `api/llama_samplers.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mlxcel.types import FinishReason, SamplingParams

_FLOAT_MAX_LOG = 88.7228391  # log of float32's largest value: the exponent is clamped below it


class Dry:
    """One request's DRY penalty (a `TokenProcessor`); `prompt` is the request's prompt token ids."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int]) -> None:
        self.multiplier, self.base = params.dry_multiplier, params.dry_base
        self.allowed_length, self.last_n = params.dry_allowed_length, params.dry_penalty_last_n
        self.prompt = list(prompt)
        self.breakers: dict[int, list[tuple[int, ...]]] = {}
        for head, tail in params.dry_breakers:
            self.breakers.setdefault(head, []).append(tuple(tail))
        self.max_exponent = int(_FLOAT_MAX_LOG / math.log(self.base)) if self.base > 1.000001 else 0

    def process(self, logits: torch.Tensor, output_ids: Sequence[int]) -> None:
        penalties = self.penalties(self._recent(output_ids))
        if penalties:
            index = torch.tensor(list(penalties), dtype=torch.long).to(logits.device)
            logits.index_put_((index,), -torch.tensor(list(penalties.values()), dtype=logits.dtype).to(logits.device),
                              accumulate=True)

    def accept(self, token_id: int) -> FinishReason | None:
        return None

    def _recent(self, output_ids: Sequence[int]) -> list[int]:
        """The context's last `last_n` tokens (all with -1), without copying the whole prompt each step."""
        if self.last_n < 0:
            return [*self.prompt, *output_ids]
        recent = list(output_ids[-self.last_n:]) if self.last_n else []
        missing = self.last_n - len(recent)
        return [*self.prompt[-missing:], *recent] if missing > 0 else recent

    def penalties(self, tokens: list[int]) -> dict[int, float]:
        """token -> the amount its logit drops, for the context `tokens`."""
        if self.multiplier == 0.0 or self.base < 1.0 or self.last_n == 0:
            return {}
        recent = tokens[-self.last_n:] if self.last_n > 0 else tokens
        reverse = recent[::-1]  # reverse[0] is the last token
        if len(reverse) <= self.allowed_length:
            return {}
        limit = self._repeat_limit(reverse)
        if limit < self.allowed_length:
            return {}
        longest: dict[int, int] = {}
        for k, length in enumerate(_z_array(reverse)):
            # the stretch ending k tokens before the last repeats the context's last `length` tokens: the token
            # that followed it (reverse[k - 1]) would extend the repeat
            length = min(length, limit)
            if k and length >= self.allowed_length and longest.get(reverse[k - 1], -1) < length:
                longest[reverse[k - 1]] = length
        return {token: self.multiplier * self.base ** self._exponent(length)
                for token, length in longest.items() if () not in self.breakers.get(token, ())}

    def _exponent(self, length: int) -> int:
        exponent = length - self.allowed_length
        return min(exponent, self.max_exponent) if self.max_exponent else exponent

    def _repeat_limit(self, reverse: list[int]) -> int:
        """How far back a repeat may reach: up to the last breaker (the longest one that ends there)."""
        for i, token in enumerate(reverse):
            tails = self.breakers.get(token)
            if not tails:
                continue
            matched = [len(t) for t in tails if len(t) <= i and all(reverse[i - 1 - o] == t[o] for o in range(len(t)))]
            if matched:
                return i - max(matched)
        return len(reverse)


def _z_array(s: list[int]) -> list[int]:
    """z[k]: the length of the longest common prefix of s and s[k:] (z[0] = 0)."""
    n = len(s)
    z = [0] * n
    left = right = 0
    for k in range(1, n):
        if k < right:
            z[k] = min(right - k, z[k - left])
        while k + z[k] < n and s[z[k]] == s[k + z[k]]:
            z[k] += 1
        if k + z[k] > right:
            left, right = k, k + z[k]
    return z
