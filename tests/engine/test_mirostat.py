"""Mirostat 1 and 2 (llama-server's `mirostat` field, issue 25's "as llama-server"): the processor's truncation
against llama.cpp's rule, and the bound steering each draw's surprise to tau, through the real sampler."""

from __future__ import annotations

import math

import pytest
import torch

from mlxcel.engine.mirostat import Mirostat, with_mirostat
from mlxcel.engine.sampler import SamplingRow, make_generator, sample
from mlxcel.types import Request, SamplingParams


def zipf_logits(vocab: int = 2000, exponent: float = 1.1) -> torch.Tensor:
    return -exponent * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))


def test_issue25_mirostat_2_keeps_the_tokens_no_more_surprising_than_mu() -> None:
    logits = zipf_logits()[torch.randperm(2000, generator=torch.Generator().manual_seed(0))]
    processor = Mirostat(SamplingParams(temperature=0.7, mirostat=2, mirostat_tau=3.0))
    row = logits.clone()
    processor.process(row, [])
    surprise = -torch.log_softmax(logits / 0.7, -1) / math.log(2)
    assert torch.equal(torch.isfinite(row), surprise <= processor.mu)  # mu starts at 2 tau
    assert torch.isfinite(row).sum() > 1
    processor.mu = -1.0  # nothing passes: the best token stays
    row = logits.clone()
    processor.process(row, [])
    assert torch.isfinite(row).nonzero().flatten().tolist() == [int(logits.argmax())]


@pytest.mark.parametrize("tau", [2.0, 4.5])
@pytest.mark.parametrize("version", [1, 2])
def test_issue25_mirostat_steers_the_observed_surprise_to_tau(version: int, tau: float) -> None:
    """Drawn through `sample` and fed back by `accept`, the draws' mean surprise (in the distribution they were
    drawn from) settles near tau, where plain sampling of the same logits sits far from it."""
    logits = zipf_logits()
    params = SamplingParams(temperature=1.0, mirostat=version, mirostat_tau=tau, mirostat_eta=0.1, seed=5)
    processor = Mirostat(params)
    row = SamplingRow(params, [], 0, frozenset(), make_generator(5), (processor,))
    surprises = []
    for _ in range(1500):
        token = sample(logits[None], [row])[0][0]
        assert processor._log_probs is not None
        surprises.append(-processor._log_probs[token].item() / math.log(2))
        processor.accept(token)
    settled = sum(surprises[500:]) / 1000
    assert abs(settled - tau) < 0.5, settled
    entropy = float(-(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum()) / math.log(2)
    assert entropy > tau + 2  # what plain sampling would average


def test_issue25_a_mirostat_request_runs_with_its_truncations_penalties_and_dry_off_and_its_own_state() -> None:
    request = Request("r", [1, 2], SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, mirostat=2,
                                                  repetition_penalty=1.1, dry_multiplier=0.8))
    ran = with_mirostat(request)
    assert (ran.sampling.top_k, ran.sampling.top_p, ran.sampling.min_p) == (0, 1.0, 0.0)
    assert (ran.sampling.repetition_penalty, ran.sampling.dry_multiplier) == (1.0, 0.0)  # llama.cpp skips both
    assert [type(p) for p in ran.processors] == [Mirostat]
    assert with_mirostat(Request("s", [1], SamplingParams(top_k=40))).sampling.top_k == 40
    assert with_mirostat(request).processors[0] is not ran.processors[0]  # state per request
