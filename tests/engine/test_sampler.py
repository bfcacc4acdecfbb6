"""Sampling (engine/sampler.py, issue 25): the batched chain equals a straightforward per-row
reference, draws follow the distribution, and a seeded row is the same alone and in any batch."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from mlxcel.engine import sampler
from mlxcel.engine.sampler import CANDIDATES, SamplingRow, make_generator, sample
from mlxcel.types import SamplingParams

EOS = 7
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])
# the GPU's way of drawing (one candidate width, its check read with the tokens, spills drawn
# again) on CPU tensors, so CI covers it without a GPU
GPU_STRATEGY_ON_CPU = pytest.param("cpu", id="cpu-gpu-strategy", marks=pytest.mark.gpu_strategy)
DEVICES = ["cpu", GPU_STRATEGY_ON_CPU, CUDA]


@pytest.fixture(autouse=True)
def _gpu_strategy(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("gpu_strategy"):
        monkeypatch.setattr(sampler, "_gpu_strategy", lambda device: True)


def row(history: list[int] = (), generated: int = 0, **params: object) -> SamplingRow:
    p = SamplingParams(**params)
    return SamplingRow(p, list(history), generated, frozenset({EOS}), make_generator(p.seed))


# ---- a straightforward per-row reference of the chain (llama.cpp's order, vLLM's temperature first) ----

def reference_final(logits: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    """One row's logits after the whole chain; removed tokens are -inf."""
    p, x = r.params, logits.clone().float()
    for token_id, value in p.logit_bias:
        if 0 <= token_id < x.shape[-1]:
            x[token_id] += value
    window = r.history if p.repeat_last_n < 0 else r.history[-p.repeat_last_n:] if p.repeat_last_n else []
    for token_id, count in Counter(window).items():
        v = x[token_id]
        v = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        x[token_id] = v - count * p.frequency_penalty - p.presence_penalty
    if p.ignore_eos or r.num_generated < p.min_tokens:
        for t in r.eos_token_ids | set(p.stop_token_ids):
            x[t] = float("-inf")
    if p.is_greedy:
        return x
    x = x if p.dynatemp_range > 0 else x / p.temperature  # a dynamic temperature comes last (llama.cpp's order)
    if p.top_n_sigma > 0:
        finite = x[torch.isfinite(x)]
        x = x.masked_fill(x < finite.max() - p.top_n_sigma * finite.std(unbiased=False), float("-inf"))
    if 0 < p.top_k < x.shape[-1]:
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    if p.typical_p < 1.0:  # llama.cpp's loop: by distance of surprisal from the entropy, until the mass passes typical_p
        probs = torch.softmax(x, -1)
        finite = torch.isfinite(x)
        entropy = -(probs[finite] * torch.log(probs[finite])).sum()
        candidates = sorted(finite.nonzero().flatten().tolist(), key=lambda t: abs(-math.log(probs[t]) - entropy))
        kept, mass = [], 0.0
        for t in candidates:
            kept.append(t)
            mass += probs[t].item()
            if mass > p.typical_p:
                break
        x = torch.full_like(x, float("-inf")).index_copy(0, torch.tensor(kept), x[kept])
    if p.top_p < 1.0:
        ordered, order = torch.sort(x, descending=True)
        probs = torch.softmax(ordered, -1)
        remove = probs.cumsum(-1) - probs >= p.top_p
        x = x.masked_fill(torch.zeros_like(remove).scatter(0, order, remove), float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(x, -1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.xtc_probability >= 1.0 and p.xtc_threshold <= 0.5:  # XTC, here on every step
        probs = torch.softmax(x, -1)
        above = sorted((probs >= p.xtc_threshold).nonzero().flatten().tolist(), key=lambda t: probs[t])
        for t in above[1:]:  # all but the least likely of them
            x[t] = float("-inf")
    if p.dynatemp_range > 0:
        probs = torch.softmax(x, -1)
        survivors = probs[probs > 0]
        share = -(survivors * survivors.log()).sum() / math.log(len(survivors)) if len(survivors) > 1 else 0.0
        low, high = max(p.temperature - p.dynatemp_range, 0.0), p.temperature + p.dynatemp_range
        x = x / (low + (high - low) * share ** p.dynatemp_exponent)
    return x


def post_sampling_distribution(logits: torch.Tensor, rows: list[SamplingRow]) -> list[dict[int, float]]:
    """The distribution each row's token was drawn from, read through the public API
    (llama-server's post-sampling probabilities with every token asked for)."""
    vocab = logits.shape[-1]
    asked = [SamplingRow(SamplingParams(**{**_fields(r.params), "logprobs": vocab, "is_post_sampling_probs": True}),
                         r.history, r.num_generated, r.eos_token_ids, r.generator, r.processors) for r in rows]
    _, logprobs = sample(logits, asked)
    return [dict(lp.top) for lp in logprobs]


def _fields(p: SamplingParams) -> dict:
    return {name: getattr(p, name) for name in SamplingParams.__dataclass_fields__}


CHAINS = [
    dict(temperature=0.8, top_p=0.95),
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=40),
    dict(temperature=1.3, top_k=20, top_p=0.5),
    dict(temperature=0.9, min_p=0.05),
    dict(temperature=1.0, top_p=0.9, min_p=0.1),
    dict(temperature=0.6, top_k=CANDIDATES[-1] + 50),  # past the candidate set: a full sort
    dict(temperature=5.0, top_p=0.99),  # a flat nucleus wider than the candidates
    dict(temperature=50.0, top_p=0.9),  # flatter still: more than NUCLEUS_MAX candidates
    dict(temperature=1.0, top_p=0.9, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
    dict(temperature=0.8, logit_bias=((3, 4.0), (5, -2.0), (10**6, 1.0)), min_tokens=5),
    dict(temperature=1.0, ignore_eos=True, top_p=0.8),
    dict(temperature=0.9, typical_p=0.6),
    dict(temperature=1.0, top_k=50, typical_p=0.8, top_p=0.9, min_p=0.02),
    dict(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.01),
    dict(temperature=0.7, typical_p=0.9, xtc_probability=1.0, xtc_threshold=0.02, top_p=0.95),
    dict(temperature=1.0, top_n_sigma=1.5),
    dict(temperature=0.8, dynatemp_range=0.5, top_k=100),
    dict(temperature=1.2, dynatemp_range=0.4, dynatemp_exponent=2.0, top_n_sigma=3.0, min_p=0.01),
]


@pytest.mark.parametrize("device", DEVICES)
def test_issue25_the_batched_chain_equals_a_per_row_reference_on_random_logits(device: str) -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(len(CHAINS), 6000, generator=generator) * 3
    history = torch.randint(0, 6000, (100,), generator=generator).tolist()
    rows = [row(history, generated=2, **chain) for chain in CHAINS]
    for r, got, logits_row in zip(rows, post_sampling_distribution(logits.to(device), rows), logits):
        expected = torch.log_softmax(reference_final(logits_row, r), -1)
        kept = torch.isfinite(expected).nonzero().flatten().tolist()
        assert sorted(got) == kept, r.params
        assert torch.allclose(torch.tensor([got[t] for t in kept]), expected[kept], atol=1e-4), r.params


# llama.cpp's own sampler cases (tests/test-sampling.cpp): probabilities in, the survivors' probabilities out
# (normalized here; XTC on every step where llama.cpp's test draws its 0.99 chance)
LLAMA_CPP_CASES = [
    ([0.1, 0.2, 0.3, 0.4], [1.0], dict(top_k=1)),
    ([0.1, 0.2, 0.3, 0.4], [0.44444, 0.33333, 0.22222], dict(top_k=3)),
    ([0.1, 0.2, 0.3, 0.4], [0.571429, 0.428571], dict(top_p=0.7)),
    ([0.1, 0.2, 0.3, 0.4], [0.44444, 0.33333, 0.22222], dict(top_p=0.8)),
    ([0.1, 0.2, 0.3, 0.4], [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9], dict(min_p=0.26)),
    ([0.1, 0.2, 0.3, 0.4], [0.4 / 0.7, 0.3 / 0.7], dict(min_p=0.51)),
    ([0.1, 0.2, 0.3, 0.4], [1.0], dict(min_p=0.76)),
    ([0.4, 0.3, 0.2, 0.1], [1.0], dict(xtc_probability=1.0, xtc_threshold=0.09)),
    ([0.4, 0.3, 0.2, 0.1], [0.2 / 0.3, 0.1 / 0.3], dict(xtc_probability=1.0, xtc_threshold=0.19)),
    ([0.4, 0.3, 0.2, 0.1], [0.5, 1 / 3, 1 / 6], dict(xtc_probability=1.0, xtc_threshold=0.29)),
    ([0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1], dict(xtc_probability=1.0, xtc_threshold=0.39)),
    ([0.97, 0.01, 0.01, 0.01], [1.0], dict(typical_p=0.5)),
    ([0.4, 0.2, 0.2, 0.2], [1 / 3, 1 / 3, 1 / 3], dict(typical_p=0.5)),
    ([0.1, 0.2, 0.3, 0.4], [0.571429, 0.428571], dict(top_n_sigma=1.0)),
    ([0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], dict(top_n_sigma=3.0)),
]


@pytest.mark.parametrize("case", LLAMA_CPP_CASES, ids=str)
def test_issue25_the_chain_keeps_what_llama_cpp_keeps(case: tuple) -> None:
    probs, expected, chain = case
    got = post_sampling_distribution(torch.tensor(probs).log()[None], [row(temperature=1.0, **chain)])[0]
    assert sorted((math.exp(v) for v in got.values()), reverse=True) == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("context, expected, penalties", [
    ([0], [0, 0.25, 0.25, 0.25, 0.25], (50.0, 0.0, 0.0)),
    ([0, 1, 2, 0, 0], [0, 0, 0, 0.5, 0.5], (50.0, 0.0, 0.0)),
    ([0, 1, 2], [0.000023, 0.000023, 0.000023, 0.499966, 0.499966], (1.0, 5.0, 5.0)),
    ([0, 1, 2, 0, 0], [0.0, 0.000023, 0.000023, 0.499977, 0.499977], (1.0, 5.0, 5.0)),
], ids=str)
def test_issue25_penalties_give_llama_cpps_probabilities(context: list[int], expected: list[float],
                                                         penalties: tuple[float, float, float]) -> None:
    repeat, frequency, presence = penalties
    r = row(context, temperature=1.0, repeat_last_n=-1, repetition_penalty=repeat, frequency_penalty=frequency,
            presence_penalty=presence)
    got = post_sampling_distribution(torch.full((1, 5), 0.2).log(), [r])[0]
    assert [math.exp(got.get(t, -math.inf)) for t in range(5)] == pytest.approx(expected, abs=1e-5)


def test_issue25_greedy_rows_with_processors_take_the_argmax_after_the_chain() -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(2))
    history = list(range(50))
    rows = [row(history, temperature=0.0, repetition_penalty=1.5), row(temperature=0.0, logit_bias=((9, 50.0),)),
            row(temperature=0.0, logprobs=3), row(temperature=0.0, ignore_eos=True)]
    tokens, _ = sample(logits, rows)
    assert tokens == [int(reference_final(x, r).argmax()) for x, r in zip(logits, rows)]
    assert tokens[1] == 9


def test_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0]])
    assert sample(logits, [row(temperature=0.0)])[0] == [1]


def test_logit_bias_moves_a_token_and_ignores_ids_outside_the_vocabulary() -> None:
    assert sample(torch.zeros(1, 5), [row(temperature=0.0, logit_bias=((4, 1.0), (99, 5.0)))])[0] == [4]
    assert sample(torch.zeros(1, 5), [row(temperature=0.0, logit_bias=((4, 1.0), (4, 1.0), (2, 1.5)))])[0] == [4]


def test_penalties_use_the_repeat_window_and_counts() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    r = row(history=[0, 1, 2, 2], temperature=1.0, repetition_penalty=2.0, repeat_last_n=3)
    # token 0 is outside the 3-token window; 1 (negative) is multiplied, 2 (positive) divided
    got = post_sampling_distribution(logits, [r])[0]
    expected = torch.log_softmax(torch.tensor([2.0, -4.0, 0.5, 1.0]), -1).tolist()
    assert [round(got[t], 5) for t in range(4)] == [round(v, 5) for v in expected]
    r = row(history=[0, 1, 1], temperature=1.0, frequency_penalty=0.5, presence_penalty=0.25, repeat_last_n=-1)
    got = post_sampling_distribution(torch.ones(1, 3), [r])[0]
    expected = torch.log_softmax(torch.tensor([1.0 - 0.5 - 0.25, 1.0 - 1.0 - 0.25, 1.0]), -1).tolist()
    assert [round(got[t], 5) for t in range(3)] == [round(v, 5) for v in expected]


def _window_counts(history: list[int], repeat_last_n: int, vocab: int) -> torch.Tensor:
    window = history if repeat_last_n < 0 else history[-repeat_last_n:] if repeat_last_n else []
    return torch.bincount(torch.tensor([t for t in window if t < vocab], dtype=torch.long), minlength=vocab).float()


def test_issue25_kept_penalty_counts_equal_the_window_counted_afresh_at_every_step() -> None:
    """Counts kept between steps (+1 new tokens, -1 leaving the window) equal a fresh count of each row's window,
    through growth by one and by several tokens, a window change, a history replaced or cut short, owner-less
    rows, and more owners than the table keeps (the least recently used give their rows up)."""
    vocab, g = 50, torch.Generator().manual_seed(3)
    table = sampler.PenaltyCounts()
    histories = {f"r{i}": torch.randint(0, vocab, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g).tolist()
                 for i in range(40)}
    windows = {owner: [64, 3, -1, 1][i % 4] for i, owner in enumerate(histories)}
    for step in range(60):
        owners = [o for o in histories if torch.rand(1, generator=g).item() < 0.3]  # each step a different subset
        for o in owners:
            histories[o] += torch.randint(0, vocab + 3, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
        if step == 20:
            windows["r0"], windows["r1"] = 2, -1  # another window: counted afresh
        if step == 30:
            histories["r2"] = torch.randint(0, vocab, (len(histories["r2"]),), generator=g).tolist()  # another list
            histories["r3"] = histories["r3"][:5]  # shorter than counted: counted afresh
        rows = [SamplingRow(SamplingParams(repetition_penalty=1.2, repeat_last_n=windows[o]), histories[o], 0, frozenset(),
                            owner=o) for o in owners]
        rows.append(SamplingRow(SamplingParams(frequency_penalty=0.5, repeat_last_n=5), [1, 2, 2, 3, 9, 9, 9], 0,
                                frozenset()))  # no owner: a row of its own, given back
        owners, token_ids, counts = table.entries(rows, vocab)
        got = torch.zeros(len(rows), vocab).index_put_((owners, token_ids), counts.float(), accumulate=True)
        expected = torch.stack([_window_counts(r.history, r.params.repeat_last_n, vocab) for r in rows])
        assert torch.equal(got, expected), step
    assert len(table._windows) < 40  # the least recently used were forgotten


def test_issue25_sampling_with_kept_penalty_counts_draws_what_fresh_counts_draw() -> None:
    """Seeded penalized rows over 40 steps: the engine's kept table and counting afresh give the same tokens."""
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(4)) * 2
    params = [dict(temperature=0.9, repetition_penalty=1.4, seed=5), dict(temperature=0.7, top_p=0.9, frequency_penalty=0.6,
              presence_penalty=0.3, repeat_last_n=-1, seed=6), dict(temperature=0.0, repetition_penalty=2.0, repeat_last_n=4)]
    runs = []
    for table in (sampler.PenaltyCounts(), None):
        rows = [SamplingRow(SamplingParams(**p), [1, 2, 3], 0, frozenset(), make_generator(p.get("seed")), owner=f"r{i}")
                for i, p in enumerate(params)]
        for _ in range(40):
            tokens, _ = sample(logits, rows, table)
            for r, t in zip(rows, tokens):
                r.history.append(t)
        runs.append([r.history for r in rows])
    assert runs[0] == runs[1]
    assert len(set(runs[0][2])) > 3  # the penalty moved the greedy row off its argmax


def test_truncations_keep_the_expected_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))

    def kept(**params: object) -> list[int]:
        return sorted(post_sampling_distribution(logits, [row(temperature=1.0, **params)])[0])
    assert kept(top_k=2) == [0, 1]
    assert kept(top_p=0.75) == [0, 1]
    assert kept(top_p=0.45) == [0]  # (at exactly 0.5 the cut falls on a float rounding)
    assert kept(min_p=0.2) == [0, 1, 2]  # 0.2 * 0.5 = 0.1


def test_min_tokens_and_ignore_eos_suppress_the_end_tokens() -> None:
    logits = torch.full((1, 10), -5.0)
    logits[0, EOS] = 10.0
    assert sample(logits, [row(temperature=0.0, min_tokens=3)])[0] != [EOS]
    assert sample(logits, [row(generated=3, temperature=0.0, min_tokens=3)])[0] == [EOS]
    assert sample(logits, [row(temperature=0.0, ignore_eos=True)])[0] != [EOS]
    assert EOS not in {sample(logits, [row(temperature=1.0, ignore_eos=True)])[0][0] for _ in range(20)}
    logits[0, 4] = 20.0  # a stop token id is suppressed by min_tokens too
    assert sample(logits, [row(temperature=0.0, min_tokens=1, stop_token_ids=(4,))])[0] not in ([4], [EOS])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chain", CHAINS[:9], ids=str)
def test_issue25_a_seeded_row_draws_the_same_tokens_alone_and_in_any_batch(chain: dict, device: str) -> None:
    logits = (torch.randn(5, 6000, generator=torch.Generator().manual_seed(0)) * 2).to(device)
    neighbours = [row(temperature=1.0), row(temperature=0.0), row(temperature=0.9, top_p=0.9, seed=7),
                  row(temperature=1.2, top_k=CANDIDATES[0] + 1)]
    alone, beside = row(seed=42, **chain), row(seed=42, **chain)
    draws_alone = [sample(logits[2:3], [alone])[0][0] for _ in range(30)]
    draws_beside = [sample(logits, [neighbours[0], neighbours[1], beside, *neighbours[2:]])[0][2] for _ in range(30)]
    assert draws_alone == draws_beside
    assert len(set(draws_alone)) > 1  # it really samples


@pytest.mark.parametrize("device", DEVICES)
def test_issue25_draws_follow_the_truncated_softmax(device: str) -> None:
    """20,000 draws of one logit vector: each token's count is within 5 standard deviations of
    its probability after temperature and top-p, and removed tokens never come."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    num = 20_000
    r = row(temperature=0.8, top_p=0.9)
    tokens, _ = sample(logits.expand(num, -1).contiguous().to(device), [r] * num)
    expected = torch.softmax(reference_final(logits, r), -1)
    counts = Counter(tokens)
    for token, p in enumerate(expected.tolist()):
        if p == 0.0:
            assert counts[token] == 0
        else:
            assert abs(counts[token] - num * p) < 5 * math.sqrt(num * p * (1 - p)) + 1, (token, counts[token], num * p)


@pytest.mark.parametrize("device", DEVICES)
def test_issue25_typical_p_and_xtc_draws_follow_their_distributions(device: str) -> None:
    """typical-p alone, and XTC on half the steps (the mixture of the cut and the whole distribution)."""
    logits = torch.tensor([3.0, 2.6, 2.0, 1.0, 0.5, 0.0, -1.0, -4.0])
    num = 20_000
    typical = row(temperature=1.0, typical_p=0.5)
    xtc = row(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.1)
    cut = torch.softmax(reference_final(logits, row(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.1)), -1)
    expectations = [(typical, torch.softmax(reference_final(logits, typical), -1)),
                    (xtc, 0.5 * torch.softmax(logits, -1) + 0.5 * cut)]
    assert cut[0] == 0.0 and cut[1] == 0.0 and cut[2] > 0.0  # XTC keeps the least likely of those past 0.1
    for r, expected in expectations:
        tokens, _ = sample(logits.expand(num, -1).contiguous().to(device), [r] * num)
        counts = Counter(tokens)
        for token, q in enumerate(expected.tolist()):
            if q == 0.0:
                assert counts[token] == 0, (r.params, token)
            else:
                assert abs(counts[token] - num * q) < 5 * math.sqrt(num * q * (1 - q)) + 1, (r.params, token, counts[token])


@pytest.mark.parametrize("device", DEVICES)
def test_issue25_seeded_typical_and_xtc_rows_draw_the_same_alone_and_in_a_batch(device: str) -> None:
    logits = (torch.randn(3, 6000, generator=torch.Generator().manual_seed(3)) * 2).to(device)
    chain = dict(temperature=0.9, typical_p=0.9, xtc_probability=0.5, xtc_threshold=0.02)
    alone, beside = row(seed=11, **chain), row(seed=11, **chain)
    draws_alone = [sample(logits[1:2], [alone])[0][0] for _ in range(30)]
    draws_beside = [sample(logits, [row(temperature=0.8, top_p=0.9), beside, row(seed=3, **chain)])[0][1] for _ in range(30)]
    assert draws_alone == draws_beside
    assert len(set(draws_alone)) > 1


def test_issue25_a_row_with_no_token_left_is_an_error_for_that_call() -> None:
    logits = torch.full((2, 6), float("-inf"))
    logits[0, 2] = 1.0
    with pytest.raises(ValueError, match="rows \\[1\\]"):
        sample(logits, [row(temperature=1.0), row(temperature=1.0)])
    assert sample(logits[:1], [row(temperature=1.0)])[0] == [2]


def test_logprobs_carry_the_chosen_token_and_top_alternatives() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    tokens, logprobs = sample(logits, [row(temperature=0.0, logprobs=2)])
    lp = logprobs[0]
    expected = torch.log_softmax(logits[0], -1)
    assert tokens == [0] and lp.token_id == 0 and math.isclose(lp.logprob, float(expected[0]), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [0, 1] and math.isclose(lp.top[1][1], float(expected[1]), rel_tol=1e-6)
    assert sample(logits, [row(temperature=0.0, logprobs=0)])[1][0].top == ()


def test_issue25_sampled_logprobs_are_the_models_own_and_post_sampling_ones_the_drawn_distribution() -> None:
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(3))
    rows = [row(temperature=0.7, top_p=0.9, logprobs=5, seed=1), row(temperature=0.0),
            row(temperature=0.7, top_p=0.9, logprobs=5, is_post_sampling_probs=True, seed=1)]
    tokens, logprobs = sample(logits, rows)
    model = torch.log_softmax(logits[0], -1)
    assert math.isclose(logprobs[0].logprob, float(model[tokens[0]]), abs_tol=1e-5)
    assert [t for t, _ in logprobs[0].top] == torch.topk(model, 5).indices.tolist()
    assert logprobs[1] is None
    drawn = torch.log_softmax(reference_final(logits[2], rows[2]), -1)
    assert math.isclose(logprobs[2].logprob, float(drawn[tokens[2]]), abs_tol=1e-5)
    assert all(math.isfinite(v) for _, v in logprobs[2].top)
    greedy = sample(logits[:1], [row(temperature=0.0, logprobs=2, is_post_sampling_probs=True)])[1][0]
    assert greedy.logprob == 0.0 and greedy.top == ((greedy.token_id, 0.0),)


@pytest.mark.parametrize("device", DEVICES)
def test_issue25_top_p_without_a_sort_draws_what_the_sorted_candidates_draw(device: str) -> None:
    """Rows asking post-sampling logprobs go the sorted-candidate way; the rest of top-p / min-p rows
    take the flat nucleus: with the same seed both must draw the same tokens."""
    logits = (torch.randn(5, 5000, generator=torch.Generator().manual_seed(5)) * 2.5).to(device)
    chains = [dict(temperature=0.8, top_p=0.95), dict(temperature=1.5, top_p=0.9, min_p=0.02),
              dict(temperature=0.7, min_p=0.1, top_p=0.99), dict(temperature=3.0, top_p=0.97),
              dict(temperature=40.0, top_p=0.9)]  # flat: more than NUCLEUS_MAX candidates
    flat = [row(seed=11 + i, **c) for i, c in enumerate(chains)]
    sorted_ = [row(seed=11 + i, logprobs=0, is_post_sampling_probs=True, **c) for i, c in enumerate(chains)]
    draws = [(sample(logits, flat)[0], sample(logits, sorted_)[0]) for _ in range(50)]
    assert all(a == b for a, b in draws)
    assert all(len({d[0][i] for d in draws}) > 1 for i in range(len(chains)))


# ---- the CPU's C++ chain (layers/kernels/sample_rows.cpp) ----

needs_native = pytest.mark.skipif(not sampler.paged_attention.available(), reason="the CPU kernels could not be built")
NATIVE_CHAINS = [*CHAINS[:9], dict(temperature=1.0, ignore_eos=True, top_p=0.8), dict(temperature=0.9, min_tokens=4),
                 dict(temperature=0.7, top_k=6000 + 10)]  # a top-k past the vocabulary keeps it all


@needs_native
@pytest.mark.parametrize("chain", NATIVE_CHAINS, ids=str)
def test_issue25_the_cpu_chain_draws_what_the_tensor_ops_draw(chain: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same seed, same logits: the C++ chain and the tensor-op chain pick the same tokens (same
    distribution, same order of the inverse-CDF walk), and the C++ one really runs."""
    logits = torch.randn(3, 6000, generator=torch.Generator().manual_seed(9)) * 2
    logits[:, EOS] = 12.0  # the best token, unless the chain removes it
    calls = []
    native = torch.ops.mlxcel.sample_rows
    monkeypatch.setattr(torch.ops.mlxcel, "sample_rows", lambda *a: calls.append(1) or native(*a), raising=False)

    def draws(seed: int) -> list[list[int]]:
        rows = [row(seed=seed + i, generated=1, **chain) for i in range(3)]
        return [sample(logits, rows)[0] for _ in range(25)]

    got = draws(3)
    assert calls
    monkeypatch.setattr(sampler, "_native_rows", lambda work, rows: [])
    assert got == draws(3)
    if chain.get("ignore_eos") or chain.get("min_tokens"):
        assert EOS not in {t for d in got for t in d}


@needs_native
@pytest.mark.parametrize("chain", [dict(temperature=0.8, top_k=3, top_p=0.95), dict(temperature=1.0),
                                   dict(temperature=0.7, min_p=0.1), dict(temperature=1.2, top_p=0.7, min_p=0.05)],
                         ids=str)
def test_issue25_the_cpu_chain_follows_the_truncated_softmax(chain: dict) -> None:
    """20,000 draws of one logit vector through the C++ chain: counts within 5 standard deviations
    of the reference chain's probabilities; removed tokens never come."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, float("-inf")])
    num = 20_000
    r = row(**chain)
    assert sampler._native_rows(logits[None], [r]) == [0]
    counts = Counter(sample(logits.expand(num, -1).contiguous(), [r] * num)[0])
    for token, p in enumerate(torch.softmax(reference_final(logits, r), -1).tolist()):
        if p == 0.0:
            assert counts[token] == 0, (token, counts[token])
        else:
            assert abs(counts[token] - num * p) < 5 * math.sqrt(num * p * (1 - p)) + 1, (token, counts[token], num * p)


@needs_native
def test_issue25_the_cpu_chain_leaves_the_logits_unchanged_and_fails_only_empty_rows() -> None:
    logits = torch.randn(2, 500, generator=torch.Generator().manual_seed(4))
    before = logits.clone()
    sample(logits, [row(temperature=0.8, top_p=0.9, ignore_eos=True), row(temperature=1.0, min_tokens=3)])
    assert torch.equal(logits, before)
    logits[1] = float("nan")
    with pytest.raises(ValueError, match="rows \\[1\\]"):
        sample(logits, [row(temperature=0.8, top_p=0.9), row(temperature=0.8, top_p=0.9)])
