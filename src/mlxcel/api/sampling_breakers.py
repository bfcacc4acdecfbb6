"""DRY's sequence breakers as token sequences (llama-server's `dry_sequence_breakers`, engine/dry.py).

A breaker string breaks a repeat wherever its text appears: a token that holds the whole string is a breaker by
itself; a token that ends with the string's beginning is the head of a breaker completed by the tokens of the
rest of the string (at most MAX_TAIL tokens). As llama.cpp does, each token's bytes are searched; the result
depends only on the vocabulary and the strings, so it is kept per tokenizer and list.
"""

from __future__ import annotations

import functools

from mlxcel.text.tokenizer import Tokenizer

DEFAULT_BREAKERS = ("\n", ":", '"', "*")  # llama-server's
MAX_BREAKER_CHARS = 40  # llama.cpp's limits: longer strings are cut, longer tails too
MAX_TAIL = 20
Breakers = tuple[tuple[int, tuple[int, ...]], ...]


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
