"""Issue 11 on the real SmolLM2: the compiled decode step gives the eager step's greedy tokens,
and a request's greedy tokens are the same alone and in a batch of 8 (random-token prompts
included), after a prefix-cache hit and with chunked prefill.

Compiling costs a few minutes once (one decoder layer and the output head); the compile cache
lives in a temporary folder, so a second start in the test reuses it (the warm restart).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mlxcel.config import EngineConfig
from mlxcel.runtime import RuntimeOptions, ServedModel, start_served_model
from mlxcel.types import Request, SamplingParams

pytestmark = pytest.mark.slow

NUM_TOKENS = 64


def serve(mode: str, cache_dir: Path, **engine: object) -> ServedModel:
    from mlxcel.loading import resolve_model

    config = EngineConfig(**{"max_num_seqs": 8, "ctx_size": 8 * 1024, "decode_step": mode,
                             "compile_cache_dir": str(cache_dir), **engine})
    return start_served_model(resolve_model(None), RuntimeOptions(warmup=mode != "eager"), config)


@pytest.fixture(scope="module")
def compile_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compile-cache")


@pytest.fixture(scope="module")
def compiled(compile_dir: Path) -> Iterator[ServedModel]:
    torch.set_num_threads(2)
    served = serve("compile", compile_dir)
    yield served
    served.close()


def prompts(served: ServedModel) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    texts = ["The capital of France is", "Write a short poem about the sea:", "def fibonacci(n):",
             "List three primary colors:"]
    return ([served.tokenizer.encode(t) for t in texts]
            + [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (7, 33, 150, 400)])


def generate(served: ServedModel, batch: list[list[int]], cache_prompt: bool = False) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        async for event in served.engine.generate(Request(f"t{i}-{time.monotonic_ns()}", prompt, params,
                                                          cache_prompt=cache_prompt)):
            tokens.extend(event.token_ids)
        return tokens

    async def all_of() -> list[list[int]]:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))

    return asyncio.run(all_of())


def test_compiled_step_matches_the_eager_step(compiled: ServedModel, compile_dir: Path) -> None:
    """The same rows over the same cache: compiled and eager logits agree to float32 rounding of a
    different summation order, and pick the same tokens. (Greedy streams of the two paths can
    still part at a near-tie after many tokens: seen at token 13 of 64 on one of four prompts.)"""
    from mlxcel.engine.decode_step import DecodeRow, DecodeStep
    from mlxcel.layers.attention import KVCache

    model = compiled.loaded.model
    args = model.args
    cache = KVCache(args.num_hidden_layers, 300, 16, args.kv_heads, args.dim_per_head, torch.bfloat16, "cpu")
    torch.manual_seed(3)
    for t in cache.k + cache.v:
        t.normal_(std=2.0)
    steps = {mode: DecodeStep(model, cache, "cpu", mode=mode, max_rows=8, max_positions=8192, cache_dir=compile_dir)
             for mode in ("eager", "compile")}
    batch = [DecodeRow(1000 + i, n - 1, 0, tuple(range(i * 60, (i + 1) * 60))) for i, n in enumerate((5, 120, 700, 33))]
    with torch.inference_mode():
        eager, fast = steps["eager"].run(batch), steps["compile"].run(batch)
    # The int8 head's logits are bfloat16 (a step of 0.125-0.25 at these magnitudes); only its
    # top candidates are recomputed in float32, so those must agree closely.
    torch.testing.assert_close(fast, eager, atol=1.0, rtol=0.05)
    top = eager.topk(8, dim=-1).indices
    # Inductor keeps fused bfloat16 intermediates in float32 where eager rounds them: close, not equal.
    torch.testing.assert_close(fast.gather(1, top), eager.gather(1, top), atol=0.5, rtol=0.02)
    assert torch.equal(fast.argmax(-1), eager.argmax(-1))


def test_greedy_tokens_are_batch_invariant(compiled: ServedModel) -> None:
    """Point 4: 8 concurrent requests, 64 greedy tokens each, identical to each request alone."""
    batch = prompts(compiled)
    alone = [generate(compiled, [p])[0] for p in batch]
    assert generate(compiled, batch) == alone
    # Again with prefix caching: the second run of each prompt starts from cached blocks.
    generate(compiled, batch, cache_prompt=True)
    assert generate(compiled, batch, cache_prompt=True) == alone


def test_chunked_prefill_gives_the_same_tokens(compiled: ServedModel, compile_dir: Path) -> None:
    chunked = serve("compile", compile_dir, max_num_batched_tokens=48)  # warm restart: the cache is filled
    try:
        batch = prompts(compiled)
        assert generate(chunked, batch) == generate(compiled, batch)
    finally:
        chunked.close()
