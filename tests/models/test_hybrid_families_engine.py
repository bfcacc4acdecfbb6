"""Issue 41 (part B): the Mamba-2, short-conv and RG-LRU hybrids through the real engine (continuous
batching, paged KV beside the recurrent-state pool, prefix cache with state snapshots, prompt-lookup
drafts with rollback) give transformers' greedy tokens: alone, in a batch, after a prefix-cache hit,
and with drafts verified."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from mlxcel.config import EngineConfig, SpeculativeConfig
from mlxcel.engine.client import EngineClient
from mlxcel.engine.loop import EngineCore, ModelShape
from mlxcel.loading import load_model
from mlxcel.types import Request, SamplingParams

from .harness import save_tiny_hf
from .test_hybrid_families import FAMILIES, VOCAB

ENGINE_FAMILIES = ["nemotron_h", "granitemoehybrid", "lfm2", "recurrent_gemma", "falcon_h1"]
_rng = random.Random(11)
PROMPTS = [[_rng.randrange(1, VOCAB) for _ in range(n)] for n in (5, 9, 14, 23)]
NUM_TOKENS = 16


def _engine(model: torch.nn.Module, **overrides: object) -> EngineClient:
    config = EngineConfig(**{"max_num_seqs": 4, "ctx_size": 4 * 64, "max_num_batched_tokens": 32, "block_size": 4,
                             "cache_type_k": "f32", "cache_type_v": "f32", **overrides})
    core = EngineCore(model, ModelShape.of(model.args), config, eos_token_ids=frozenset())
    core.start()
    return EngineClient(core)


@pytest.fixture(scope="module", params=ENGINE_FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp(request.param)
    reference = save_tiny_hf(FAMILIES[request.param][1](), folder)
    model = load_model(folder).model
    client = _engine(model)
    yield reference, client, model
    client.core.stop(10)


@torch.inference_mode()
def transformers_greedy(reference: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    for _ in range(NUM_TOKENS):
        ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


async def _generate(client: EngineClient, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    tokens, cached = [], 0
    sampling = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    async for event in client.generate(Request(request_id, prompt, sampling)):
        tokens.extend(event.token_ids)
        cached = event.num_cached_tokens or cached
    return tokens, cached


async def _batch(client: EngineClient, tag: str) -> list[tuple[list[int], int]]:
    return list(await asyncio.gather(*(_generate(client, f"{tag}{i}", p) for i, p in enumerate(PROMPTS))))


def test_issue41_hybrid_in_the_engine_alone_batched_and_after_a_prefix_hit(family) -> None:
    reference, client, _ = family
    expected = [transformers_greedy(reference, p) for p in PROMPTS]
    alone, _ = asyncio.run(_generate(client, "alone", PROMPTS[-1]))
    assert alone == expected[-1]
    batched = asyncio.run(_batch(client, "batch"))
    assert [tokens for tokens, _ in batched] == expected
    again = asyncio.run(_batch(client, "again"))  # every prompt's full blocks are cached by now
    assert [tokens for tokens, _ in again] == expected
    assert [cached for _, cached in again] == [(len(p) - 1) // 4 * 4 for p in PROMPTS]


def test_issue41_hybrid_with_prompt_lookup_drafts_keeps_its_greedy_tokens(family) -> None:
    """Verified drafts, accepted or rolled back (the recurrent state of the last accepted row), leave
    transformers' greedy tokens."""
    reference, _, model = family
    client = _engine(model, speculative=SpeculativeConfig(draft_kind="prompt-lookup", draft_max=4, max_batch=4,
                                                          ngram_size=2))
    try:
        prompt = PROMPTS[1] * 3  # repeats give the n-gram lookup drafts to verify
        tokens, _ = asyncio.run(_generate(client, "spec", prompt))
        assert tokens == transformers_greedy(reference, prompt)
    finally:
        client.core.stop(10)
