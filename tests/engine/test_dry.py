"""DRY (llama-server's `dry_*` fields, issue 25): the penalty against the cases llama.cpp's own sampler tests
check (tests/test-sampling.cpp: probabilities before, the context, probabilities after), breakers made of
several tokens, and the breaker strings worked out from a real vocabulary."""

from __future__ import annotations

import math

import pytest
import torch

from mlxcel.engine.dry import Dry
from mlxcel.types import SamplingParams

# (probabilities, context, expected probabilities, multiplier, base, allowed length, last n, breakers)
LLAMA_CPP_CASES = [
    ([0.25] * 4, [0, 1], [0.25] * 4, 1.0, 1.1, 2, 4, ()),
    ([0.25] * 4, [0, 1, 2, 0, 1], [0.296923, 0.296923, 0.109232, 0.296923], 1.0, 1.1, 2, 5, ()),
    ([0.2] * 5, [0, 1, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 2, 6, ((3, ()),)),
    ([0.2] * 5, [0, 1, 2, 0, 1], [0.241818, 0.241818, 0.032727, 0.241818, 0.241818], 2.0, 1.1, 2, 5, ()),
    ([0.2] * 5, [0, 1, 2, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 4, 7, ()),
]


@pytest.mark.parametrize("case", LLAMA_CPP_CASES, ids=str)
def test_issue25_dry_penalizes_as_llama_cpp_does(case: tuple) -> None:
    probs, context, expected, multiplier, base, allowed, last_n, breakers = case
    params = SamplingParams(dry_multiplier=multiplier, dry_base=base, dry_allowed_length=allowed,
                            dry_penalty_last_n=last_n, dry_breakers=breakers)
    logits = torch.log(torch.tensor(probs))
    Dry(params, context[:2]).process(logits, context[2:])  # the prompt and the output read as one context
    assert torch.allclose(torch.softmax(logits, -1), torch.tensor(expected), atol=1e-5)


def test_issue25_a_repeat_stops_at_a_breaker_of_several_tokens_and_a_breaker_token_goes_free() -> None:
    """Context 1 2 3 4 1 2 3: 4 would extend the repeat "1 2 3". A breaker "2 3" inside the repeat stops it (only
    what follows the context's last breaker may repeat); "2 5" does not occur, so it does not. In 1 2 9 1 2, 9 would
    extend "1 2", but a token that is a breaker by itself is never penalized."""
    plain = dict(dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=2, dry_penalty_last_n=-1)
    context = [1, 2, 3, 4, 1, 2, 3]
    assert Dry(SamplingParams(**plain), []).penalties(context) == {4: 2.0}
    assert Dry(SamplingParams(**plain, dry_breakers=((2, (3,)),)), []).penalties(context) == {}
    assert Dry(SamplingParams(**plain, dry_breakers=((2, (5,)),)), []).penalties(context) == {4: 2.0}
    assert Dry(SamplingParams(**plain), []).penalties([1, 2, 9, 1, 2]) == {9: 1.0}
    assert Dry(SamplingParams(**plain, dry_breakers=((9, ()),)), []).penalties([1, 2, 9, 1, 2]) == {}


def test_issue25_long_repeats_clamp_their_exponent() -> None:
    context = [1, 2] * 400
    penalties = Dry(SamplingParams(dry_multiplier=1.0, dry_base=1.75, dry_penalty_last_n=-1), context).penalties(context)
    assert math.isfinite(penalties[1]) and penalties[1] > 1e37
