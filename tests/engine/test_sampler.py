"""Sampling processors (engine/sampler.py): each parameter does what llama.cpp/vLLM users expect."""

from __future__ import annotations

import math

import torch

from mlxcel.engine.sampler import (
    SamplingRow, apply_logit_bias, apply_penalties, make_generator, min_p_filter, sample, top_k_filter,
    top_p_filter,
)
from mlxcel.types import SamplingParams

EOS = 7


def row(history: list[int] = (), generated: int = 0, **params: object) -> SamplingRow:
    p = SamplingParams(**params)
    return SamplingRow(p, list(history), generated, frozenset({EOS}), make_generator(p.seed))


def test_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0]])
    assert sample(logits, [row(temperature=0.0)])[0] == [1]


def test_logit_bias_moves_a_token_and_ignores_ids_outside_the_vocabulary() -> None:
    logits = torch.zeros(5)
    apply_logit_bias(logits, ((2, 5.0), (99, 1.0), (3, -100.0)))
    assert logits.tolist() == [0.0, 0.0, 5.0, -100.0, 0.0]
    assert sample(torch.zeros(1, 5), [row(temperature=0.0, logit_bias=((4, 1.0),))])[0] == [4]


def test_penalties_use_the_repeat_window_and_counts() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 1.0])
    apply_penalties(logits, row(history=[0, 1, 2, 2], repetition_penalty=2.0, repeat_last_n=3))
    # token 0 is outside the 3-token window; 1 (negative) is multiplied, 2 (positive) divided
    assert logits.tolist() == [2.0, -4.0, 0.5, 1.0]
    logits = torch.tensor([1.0, 1.0, 1.0])
    apply_penalties(logits, row(history=[0, 1, 1], frequency_penalty=0.5, presence_penalty=0.25, repeat_last_n=-1))
    assert logits.tolist() == [1.0 - 0.5 - 0.25, 1.0 - 1.0 - 0.25, 1.0]


def test_truncations_keep_the_expected_tokens() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isfinite(top_k_filter(logits, 2)).tolist() == [True, True, False, False]
    assert torch.isfinite(top_p_filter(logits, 0.75)).tolist() == [True, True, False, False]
    assert torch.isfinite(top_p_filter(logits, 0.5)).tolist() == [True, False, False, False]
    assert torch.isfinite(min_p_filter(logits, 0.2)).tolist() == [True, True, True, False]  # 0.2 * 0.5 = 0.1


def test_min_tokens_and_ignore_eos_suppress_the_end_tokens() -> None:
    logits = torch.full((1, 10), -5.0)
    logits[0, EOS] = 10.0
    assert sample(logits, [row(temperature=0.0, min_tokens=3)])[0] != [EOS]
    assert sample(logits, [row(generated=3, temperature=0.0, min_tokens=3)])[0] == [EOS]
    assert sample(logits, [row(temperature=0.0, ignore_eos=True)])[0] != [EOS]
    logits[0, 4] = 20.0  # a stop token id is suppressed by min_tokens too
    assert sample(logits, [row(temperature=0.0, min_tokens=1, stop_token_ids=(4,))])[0] not in ([4], [EOS])


def test_a_seed_gives_the_same_draws_whatever_else_is_sampled() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    alone, beside = row(temperature=1.0, seed=42), row(temperature=1.0, seed=42)
    draws_alone = [sample(logits[:1], [alone])[0][0] for _ in range(20)]
    # the same seed, sampled beside two unseeded rows each step
    draws_beside = [sample(logits, [beside, row(temperature=1.0), row(temperature=1.0)])[0][0] for _ in range(20)]
    assert draws_alone == draws_beside
    assert len(set(draws_alone)) > 1  # it really samples


def test_logprobs_carry_the_chosen_token_and_top_alternatives() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    tokens, logprobs = sample(logits, [row(temperature=0.0, logprobs=2)])
    lp = logprobs[0]
    expected = torch.log_softmax(logits[0], -1)
    assert tokens == [0] and lp.token_id == 0 and math.isclose(lp.logprob, float(expected[0]), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [0, 1] and math.isclose(lp.top[1][1], float(expected[1]), rel_tol=1e-6)
    assert sample(logits, [row(temperature=0.0, logprobs=0)])[1][0].top == ()
