"""Tiny random Llama models and engines for fast engine tests."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mlxcel.config import EngineConfig
from mlxcel.engine.client import EngineClient
from mlxcel.engine.loop import EngineCore, ModelShape
from mlxcel.layers.attention import AttentionContext, SequenceSlice
from mlxcel.models import llama
from mlxcel.types import Request, SamplingParams

VOCAB = 97
EOS = 3


def random_llama(seed: int, *, hidden_size: int = 64, num_layers: int = 2, std: float = 0.3) -> llama.Model:
    """A tiny random Llama (4 heads over 2 KV heads, vocabulary 97); larger weights than the
    default init make logits far from ties."""
    torch.manual_seed(seed)
    args = llama.ModelArgs(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB,
                           max_position_embeddings=512, tie_word_embeddings=True)
    model = llama.Model(args)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=std)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_model() -> llama.Model:
    return random_llama(0)


def reference_greedy(model: llama.Model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with no KV cache at all (the whole sequence every step), EOS suppressed."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            t = torch.tensor(ids)
            h = model(t, torch.arange(len(ids)), AttentionContext([SequenceSlice(0, len(ids), len(ids))]))
            logits = model.compute_logits(h[-1])
            logits[EOS] = float("-inf")  # the engine requests below use ignore_eos
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def make_engine(model: llama.Model, **overrides: object) -> EngineClient:
    config = EngineConfig(**{"max_num_seqs": 8, "ctx_size": 8 * 128, "max_num_batched_tokens": 64,
                             "block_size": 4, "cache_type_k": "f32", "cache_type_v": "f32",
                             **overrides})
    core = EngineCore(model, ModelShape(2, 2, 16, 512), config, eos_token_ids=frozenset({EOS}))
    core.start()
    return EngineClient(core)


@pytest.fixture
def engine(tiny_model: llama.Model):
    client = make_engine(tiny_model)
    yield client
    client.core.stop(10)


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


async def collect(client: EngineClient, request: Request) -> tuple[list[int], object]:
    tokens: list[int] = []
    last = None
    async for event in client.generate(request):
        tokens.extend(event.token_ids)
        last = event
    return tokens, last


def run(coro):  # noqa: ANN001, ANN201 - tiny test helper
    return asyncio.run(coro)
