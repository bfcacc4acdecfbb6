"""Speculative decoding (B2, B4) on tiny random models: prompt-lookup drafts, verification in the
batch scheduler, the temperature-0 identity with plain decoding, rejection-sampling acceptance."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mlxcel.config import SpeculativeConfig
from mlxcel.engine.spec.prompt_lookup import lookup_draft
from mlxcel.types import Request, SamplingParams

from tests.engine.conftest import collect, greedy, make_engine, reference_greedy, run

LOOKUP = SpeculativeConfig(draft_kind="prompt-lookup", draft_max=6, max_batch=8, ngram_size=2)


def test_lookup_draft_copies_what_followed_the_latest_earlier_match() -> None:
    assert lookup_draft([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2], 3, 4) == (3, 5, 6, 1)
    assert lookup_draft([7, 8, 9, 7, 8], 3, 10) == (9, 7, 8)
    assert lookup_draft([1, 2, 3], 2, 4) == ()  # no earlier occurrence of any suffix n-gram
    assert lookup_draft([5, 6, 5, 6], 2, 1) == (5,)


def repetitive_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    span = torch.randint(5, 97, (n,), generator=g).tolist()
    return span + span[: n // 2]


def test_greedy_stream_equals_plain_decoding_alone_and_batched(tiny_model) -> None:
    prompts = [repetitive_prompt(n, i) for i, n in enumerate((12, 30, 7, 45))]
    plain = make_engine(tiny_model)
    spec = make_engine(tiny_model, speculative=LOOKUP)
    try:
        async def batch(client):  # noqa: ANN001, ANN202
            reqs = [Request(f"r{i}", p, greedy(40)) for i, p in enumerate(prompts)]
            return await asyncio.gather(*(collect(client, r) for r in reqs))
        expected = [t for t, _ in run(batch(plain))]
        alone = [run(collect(spec, Request(f"a{i}", p, greedy(40))))[0] for i, p in enumerate(prompts)]
        batched = [t for t, _ in run(batch(spec))]
        stats = spec.core.stats().drafts
    finally:
        plain.core.stop(10)
        spec.core.stop(10)
    assert alone == expected and batched == expected
    assert expected[0] == reference_greedy(tiny_model, prompts[0], 40)
    assert stats.num_drafted > 0 and 0 < stats.num_accepted <= stats.num_drafted


class FirstTokenForcer:
    """A TokenProcessor that makes the first output token `token` and leaves the rest alone."""

    def __init__(self, token: int) -> None:
        self.token = token

    def process(self, logits: torch.Tensor, output_ids) -> None:  # noqa: ANN001
        if not output_ids:
            logits.fill_(float("-inf"))
            logits[self.token] = 0.0

    def accept(self, token_id: int) -> None:
        return None


class FixedDrafter:
    """Always drafts the same tokens (a point mass), to drive acceptance and rejection alike."""

    kind = "fixed"

    def __init__(self, draft: tuple[int, ...]) -> None:
        self.draft = draft

    def propose(self, seq, max_len: int) -> tuple[int, ...]:  # noqa: ANN001
        return self.draft[:max_len]

    def free(self, request_id: str) -> None:
        return None


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1 % point of chi-square with `df` degrees of freedom (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def target_probs(model, ids: list[int], temperature: float, top_k: int) -> torch.Tensor:  # noqa: ANN001
    from mlxcel.layers.attention import AttentionContext, SequenceSlice

    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), AttentionContext([SequenceSlice(0, len(ids), len(ids))]))
        logits = model.compute_logits(hidden[-1]).float()
    scaled = logits / temperature
    return torch.softmax(scaled.masked_fill(scaled < torch.topk(scaled, top_k).values[-1], float("-inf")), dim=-1)


def test_rejection_sampling_keeps_the_target_distribution(tiny_model) -> None:
    """B4 with sampling: the first verified token's frequencies over many seeded requests match the
    target's own distribution (chi-square at 0.1 %), whether the point-mass draft is taken or not."""
    from mlxcel.engine.spec import DraftPolicy
    from mlxcel.engine.loop import EngineCore, ModelShape
    from mlxcel.engine.client import EngineClient
    from mlxcel.config import EngineConfig

    prompt, forced, temperature, top_k, trials = [5, 6, 7, 8, 9, 10, 11], 40, 0.25, 8, 1500
    probs = target_probs(tiny_model, prompt + [forced], temperature, top_k)
    draft = int(probs.argsort(descending=True)[1])  # the second most likely: accepted now and then
    config = EngineConfig(max_num_seqs=8, ctx_size=8 * 64, block_size=4, cache_type_k="f32", cache_type_v="f32",
                          max_queue_depth=trials,
                          speculative=SpeculativeConfig(draft_kind="prompt-lookup", draft_max=2, max_batch=8))
    policy = DraftPolicy(config.speculative, FixedDrafter((draft, draft)))
    core = EngineCore(tiny_model, ModelShape(2, 2, 16, 512), config, eos_token_ids=frozenset({3}), drafts=policy)
    core.start()
    client = EngineClient(core)

    async def one(seed: int) -> list[int]:
        params = SamplingParams(temperature=temperature, top_k=top_k, seed=seed, max_tokens=3, ignore_eos=True)
        tokens, _ = await collect(client, Request(f"d{seed}", list(prompt), params,
                                                  processors=(FirstTokenForcer(forced),)))
        return tokens

    async def all_trials() -> list[list[int]]:
        return await asyncio.gather(*(one(seed) for seed in range(trials)))

    try:
        outputs = run(all_trials())
    finally:
        core.stop(10)
    assert all(out[0] == forced and len(out) == 3 for out in outputs)
    counts = torch.bincount(torch.tensor([out[1] for out in outputs]), minlength=probs.numel()).double()
    expected = probs.double() * trials
    kept = expected >= 5
    observed = torch.cat((counts[kept], counts[~kept].sum().view(1)))
    wanted = torch.cat((expected[kept], expected[~kept].sum().view(1)))
    statistic = float(((observed - wanted) ** 2 / wanted.clamp(min=1e-9)).sum())
    assert statistic < chi2_critical(int(kept.sum())), (statistic, counts[kept].tolist(), wanted.tolist())
    assert policy.num_drafted >= trials  # every request verified a draft
    accepted = float((torch.tensor([out[1] for out in outputs]) == draft).double().mean())
    assert policy.num_accepted >= accepted * trials  # the accepted second-token drafts were counted
    assert 0.05 < accepted < 0.95  # both the accept and the reject path were taken


def model_drafter_engine(model, **overrides: object):  # noqa: ANN001, ANN201
    """An engine whose drafter is `model` itself (B1 mechanics: the draft model drafts for itself)."""
    from mlxcel.config import EngineConfig
    from mlxcel.engine.client import EngineClient
    from mlxcel.engine.loop import EngineCore, ModelShape
    from mlxcel.engine.spec import DraftPolicy
    from mlxcel.engine.spec.draft_model import ModelDrafter

    spec = SpeculativeConfig(draft_kind="full-model", draft_model="tiny", draft_max=4, max_batch=8)
    config = EngineConfig(**{"max_num_seqs": 8, "ctx_size": 8 * 128, "max_num_batched_tokens": 64, "block_size": 4,
                             "cache_type_k": "f32", "cache_type_v": "f32", "speculative": spec, **overrides})
    shape = ModelShape(2, 2, 16, 512)
    drafter = ModelDrafter(model, shape, num_blocks=8 * 40, block_size=4, device="cpu", dtype=torch.float32,
                           mode="eager", max_rows=8)
    core = EngineCore(model, shape, config, eos_token_ids=frozenset({3}), drafts=DraftPolicy(spec, drafter))
    core.start()
    return EngineClient(core), drafter


def test_full_model_drafter_gives_plain_decodings_stream_and_frees_its_kv(tiny_model) -> None:
    prompts = [repetitive_prompt(n, 10 + i) for i, n in enumerate((9, 26, 40))]
    client, drafter = model_drafter_engine(tiny_model)
    try:
        async def batch():  # noqa: ANN202
            reqs = [Request(f"m{i}", p, greedy(30)) for i, p in enumerate(prompts)]
            return await asyncio.gather(*(collect(client, r) for r in reqs))
        batched = [t for t, _ in run(batch())]
        alone = [run(collect(client, Request(f"n{i}", p, greedy(30))))[0] for i, p in enumerate(prompts)]
        stats = client.core.stats().drafts
        used_after = drafter.kv.pool.num_used_blocks
        draft_cache = drafter.kv.stats()
    finally:
        client.core.stop(10)
    expected = [reference_greedy(tiny_model, p, 30) for p in prompts]
    assert batched == expected and alone == expected
    # Drafting for itself, the drafter is right nearly always (its prefill and decode rows round alike here).
    assert stats.num_drafted > 30 and stats.num_accepted >= 0.9 * stats.num_drafted
    assert drafter.num_requests == 0 and used_after == 0  # every request's draft KV went with it
    assert draft_cache.num_hits >= len(prompts)  # the second run of each prompt reused its draft KV blocks


def test_an_aborted_request_frees_its_draft_kv(tiny_model) -> None:
    client, drafter = model_drafter_engine(tiny_model)
    try:
        async def abort_midway() -> None:
            request = Request("ab", repetitive_prompt(20, 3), greedy(200))
            async for event in client.generate(request):
                if len(event.token_ids) and drafter.num_requests:
                    break  # closing the stream aborts the request
        run(abort_midway())
        deadline = 200
        while (drafter.num_requests or client.core.stats().active_sequences) and deadline:
            import time
            time.sleep(0.01)
            deadline -= 1
    finally:
        client.core.stop(10)
    assert drafter.num_requests == 0 and drafter.kv.pool.num_used_blocks == 0


class Seq:
    """The little of a Sequence that a drafter and the policy read."""

    def __init__(self, request_id: str, token_ids: list[int]) -> None:
        self.request_id, self.token_ids = request_id, token_ids


def test_policy_gates_on_batch_size_and_draft_min_and_adapts_the_length() -> None:
    from mlxcel.engine.spec import DraftPolicy

    policy = DraftPolicy(SpeculativeConfig(draft_kind="prompt-lookup", draft_max=8, draft_min=2, max_batch=2),
                         FixedDrafter(tuple(range(10, 20))))
    seq = Seq("a", [1, 2, 3])
    assert policy.draft(seq, num_running=3, room=50) == ()  # more rows than --prompt-lookup-max-batch
    assert policy.draft(seq, num_running=2, room=1) == ()  # room below --draft-min
    assert policy.draft(seq, num_running=2, room=50) == tuple(range(10, 18))  # --draft-max
    policy.record("a", 8, 1)
    assert len(policy.draft(seq, 1, 50)) == 2  # one past the accepted count (but at least --draft-min)
    policy.record("a", 2, 2)
    assert len(policy.draft(seq, 1, 50)) == 4  # doubled after a fully accepted draft
    policy.free("a")
    assert len(policy.draft(seq, 1, 50)) == 8 and (policy.num_drafted, policy.num_accepted) == (10, 3)


class Ban:
    """A TokenProcessor that forbids one token (as a grammar forbids what it cannot accept)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def process(self, logits: torch.Tensor, output_ids) -> None:  # noqa: ANN001
        logits[self.token] = float("-inf")

    def accept(self, token_id: int) -> None:
        assert token_id != self.token
        return None


def test_a_draft_token_the_processor_forbids_ends_the_draft(tiny_model) -> None:
    """The target's processors run per verified position: a forbidden draft token is never accepted,
    and the stream equals plain decoding under the same processor."""
    from mlxcel.config import EngineConfig
    from mlxcel.engine.client import EngineClient
    from mlxcel.engine.loop import EngineCore, ModelShape
    from mlxcel.engine.spec import DraftPolicy

    prompt = repetitive_prompt(20, 5)
    banned = reference_greedy(tiny_model, prompt, 1)[0]  # the token plain decoding would pick first
    config = EngineConfig(max_num_seqs=2, ctx_size=2 * 128, block_size=4, cache_type_k="f32", cache_type_v="f32",
                          speculative=SpeculativeConfig(draft_kind="prompt-lookup", draft_max=3, max_batch=2))
    policy = DraftPolicy(config.speculative, FixedDrafter((banned, banned, banned)))
    streams = []
    plain = EngineConfig(max_num_seqs=2, ctx_size=2 * 128, block_size=4, cache_type_k="f32", cache_type_v="f32")
    for engine_config, drafts in ((plain, None), (config, policy)):
        core = EngineCore(tiny_model, ModelShape(2, 2, 16, 512), engine_config, eos_token_ids=frozenset({3}),
                          drafts=drafts)
        core.start()
        try:
            tokens, _ = run(collect(EngineClient(core), Request("g", list(prompt), greedy(12), processors=(Ban(banned),))))
        finally:
            core.stop(10)
        streams.append(tokens)
    assert streams[1] == streams[0] and banned not in streams[1]
    assert policy.num_drafted > 0 and policy.num_accepted == 0
