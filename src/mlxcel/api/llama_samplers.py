"""llama-server's samplers beyond temperature, top-k, top-p and min-p, as /completion and the OpenAI routes take them:
typical-p, XTC, top-n-sigma, dynamic temperature, mirostat and DRY (the fields, their SamplingParams, the echo in
`generation_settings`), and DRY's sequence breakers as token sequences (engine/dry.py).

A breaker string breaks a repeat wherever its text appears: a token that holds the whole string is a breaker by
itself; a token that ends with the string's beginning is the head of a breaker completed by the tokens of the
rest of the string (at most MAX_TAIL tokens). As llama.cpp does, each token's bytes are searched; the result
depends only on the vocabulary and the strings, so it is kept per tokenizer and list.
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import Field

from mlxcel.api.schema import WireModel
from mlxcel.text.tokenizer import Tokenizer

DEFAULT_BREAKERS = ("\n", ":", '"', "*")  # llama-server's
MAX_BREAKER_CHARS = 40  # llama.cpp's limits: longer strings are cut, longer tails too
MAX_TAIL = 20
Breakers = tuple[tuple[int, tuple[int, ...]], ...]


class LlamaSamplerFields(WireModel):
    """The fields, by llama-server's names and defaults (each off by default)."""

    typical_p: float = Field(1.0, ge=0.0, le=1.0)  # 1 = off
    xtc_probability: float = Field(0.0, ge=0.0, le=1.0)  # 0 = off
    xtc_threshold: float = Field(0.1, ge=0.0, le=1.0)  # past 0.5 XTC is off
    top_n_sigma: float = -1.0  # <= 0 = off
    dynatemp_range: float = Field(0.0, ge=0.0)  # 0 = off
    dynatemp_exponent: float = Field(1.0, ge=0.0)
    mirostat: int = Field(0, ge=0, le=2)  # 1 or 2 replaces the truncations; 0 = off
    mirostat_tau: float = Field(5.0, ge=0.0)
    mirostat_eta: float = Field(0.1, ge=0.0)
    dry_multiplier: float = Field(0.0, ge=0.0)  # DRY (0 = off)
    dry_base: float = Field(1.75, ge=0.0)
    dry_allowed_length: int = Field(2, ge=0)
    dry_penalty_last_n: int = Field(64, ge=-1)  # -1: the whole context
    dry_sequence_breakers: list[str] | None = Field(None, min_length=1)  # None: newline, ':', '"', '*'

    def sampling_fields(self, tokenizer: Tokenizer) -> dict[str, Any]:
        """These fields as SamplingParams keyword arguments (DRY's breakers as tokens, worked out once)."""
        values = {name: getattr(self, name) for name in LlamaSamplerFields.model_fields if name != "dry_sequence_breakers"}
        values["dry_breakers"] = dry_breakers(tokenizer, self.dry_sequence_breakers) if self.dry_multiplier else ()
        return values

    def settings(self) -> dict[str, Any]:
        """The fields as `generation_settings` shows them (llama-server lists the default breakers)."""
        values = {name: getattr(self, name) for name in LlamaSamplerFields.model_fields}
        return {**values, "dry_sequence_breakers": list(self.dry_sequence_breakers or DEFAULT_BREAKERS)}


def dry_breakers(tokenizer: Tokenizer, strings: list[str] | tuple[str, ...] | None) -> Breakers:
    """(head token, tail tokens) for each way each breaker can start in a token; `strings` None: the default."""
    return _breakers(tokenizer, tuple(s[:MAX_BREAKER_CHARS] for s in (DEFAULT_BREAKERS if strings is None else strings)
                                      if s))


@functools.lru_cache(maxsize=8)
def _breakers(tokenizer: Tokenizer, strings: tuple[str, ...]) -> Breakers:
    words = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    found: dict[tuple[int, tuple[int, ...]], None] = {}  # ordered, without duplicates
    for text in strings:
        wanted = text.encode("utf-8")
        for token_id, word in enumerate(words):
            if wanted in word:
                found[(token_id, ())] = None
                continue
            for start in _starts_of_a_prefix(word, wanted):  # the word ends with the breaker's first bytes
                rest = wanted[len(word) - start:].decode("utf-8", errors="ignore")
                found[(token_id, tuple(tokenizer.encode(rest, add_special_tokens=False)[:MAX_TAIL]))] = None
    return tuple(found)


def _starts_of_a_prefix(word: bytes, wanted: bytes) -> list[int]:
    """Positions in `word` from which the rest of `word` is a proper beginning of `wanted`."""
    return [start for start in range(max(len(word) - len(wanted) + 1, 0), len(word))
            if wanted.startswith(word[start:])]
