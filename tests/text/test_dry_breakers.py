"""DRY's sequence breakers worked out from a real vocabulary (SmolLM2's): a token holding a breaker string breaks
by itself, a string of several tokens becomes a head token and its tail (issue 25, llama-server's
`dry_sequence_breakers`)."""

from __future__ import annotations

from mlxcel.api.llama_samplers import dry_breakers
from mlxcel.text.tokenizer import Tokenizer


def test_issue25_dry_breakers_from_the_real_vocabulary(smollm2_tokenizer: Tokenizer) -> None:
    tokenizer = smollm2_tokenizer
    breakers = dry_breakers(tokenizer, None)  # newline, ':', '"', '*'
    alone = {head for head, tail in breakers if not tail}
    assert {tokenizer.encode(text, add_special_tokens=False)[0] for text in ("\n", ":", '"', "*")} <= alone
    assert all(any(mark in tokenizer.token_bytes(head) for mark in (b"\n", b":", b'"', b"*")) for head in alone)
    assert len(alone) > 100  # every token holding one, e.g. ".\n\n" and "://"
    several = dry_breakers(tokenizer, ["<|im_end|>x"])  # no token holds it whole
    im_end = tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]
    assert (im_end, tuple(tokenizer.encode("x", add_special_tokens=False))) in several
    assert all(tail for _, tail in several)
    assert dry_breakers(tokenizer, None) is breakers  # worked out once per tokenizer and list
