"""Issue 11 on the real SmolLM2 (Q4_1, packed 4-bit decode matmuls, bf16 KV): a repeated prompt whose
every 16-token block is cached computes only its last token (through the decode step, writing no KV)
and gives the cold request's greedy tokens; a prompt with a partial last block computes its tail as the cold
prompt does (a tail of 1-4 through the decode step, a longer one through the prefill: issue 25), with the
same bits."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from mlxcel.config import EngineConfig
from mlxcel.serving.chat_model import start_served_model
from mlxcel.serving.served_model import RuntimeOptions, ServedModel
from mlxcel.types import Request, SamplingParams

pytestmark = pytest.mark.slow

NUM_TOKENS = 32
TEXT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 40


@pytest.fixture(scope="module")
def served() -> Iterator[ServedModel]:
    from mlxcel.loading import resolve_model

    torch.set_num_threads(2)
    model = start_served_model(resolve_model(None), RuntimeOptions(threads=2, warmup=False),
                               EngineConfig(max_num_seqs=2, ctx_size=2 * 1024, decode_step="eager"))
    yield model
    model.close()


def generate(served: ServedModel, request_id: str, prompt: list[int]) -> tuple[list[int], int, list[float]]:
    """Greedy tokens, the prompt tokens taken from the cache, and each token's logprob."""
    async def run() -> tuple[list[int], int, list[float]]:
        tokens: list[int] = []
        logprobs: list[float] = []
        cached = 0
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
        async for event in served.engine.generate(Request(request_id, prompt, params)):
            tokens.extend(event.token_ids)
            logprobs.extend(entry.logprob for entry in event.logprobs or ())
            cached = event.num_cached_tokens
        return tokens, cached, logprobs

    return asyncio.run(run())


# 240 + 1..4: the tail after the cached blocks goes through the decode step, cold and after the hit (issue 25,
# engine/runner.py); 240 + 8 and + 10: through the prefill, whose last query tile of 1-3 rows the CPU's attention
# would multiply with another kernel than the cold prompt's fuller tile, were it not padded (layers/attention.py)
@pytest.mark.parametrize("length, expected_cached",
                         [(256, 255), (250, 240), (241, 240), (242, 240), (243, 240), (244, 240), (248, 240)])
def test_a_repeated_prompt_gives_the_cold_tokens(served: ServedModel, length: int, expected_cached: int) -> None:
    prompt = served.tokenizer.encode(f"Story {length}: {TEXT}")[:length]  # no prefix shared between cases
    assert len(prompt) == length
    cold, cold_cached, cold_logprobs = generate(served, f"cold-{length}", prompt)
    hit, hit_cached, hit_logprobs = generate(served, f"hit-{length}", prompt)
    assert cold_cached == 0 and hit_cached == expected_cached
    assert hit == cold
    assert len(hit_logprobs) == NUM_TOKENS
    if expected_cached % 16 == 0:  # whole blocks from the cache, the tail prefilled: the same bits as the cold prompt's, not only the argmax
        assert hit_logprobs == cold_logprobs
    else:  # the last token alone through this eager decode step, whose bits are its own
        assert hit_logprobs[1:] == cold_logprobs[1:]
