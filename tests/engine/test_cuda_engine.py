"""Issue 11 on CUDA: the engine with a decode step and a long prompt's chunked prefill in the same steps.

Since the step's logits stay on the device, a prefill chunk that samples nothing (a middle chunk of
a long prompt) must add no host-side logits beside the decode rows' (0566b3e). Runs where CUDA is
(the lent GPU: `PYTHONPATH=src python3 -m pytest tests/engine/test_cuda_engine.py`); skipped elsewhere.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from mlxcel.config import EngineConfig
from mlxcel.engine.client import EngineClient
from mlxcel.engine.loop import EngineCore, ModelShape
from mlxcel.types import Request
from tests.engine.conftest import EOS, collect, greedy, random_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cuda_engine(decode_step: str) -> EngineClient:
    model = random_llama(0).to("cuda")
    config = EngineConfig(max_num_seqs=4, ctx_size=4 * 512, max_num_batched_tokens=64, block_size=16,
                          cache_type_k="f32", cache_type_v="f32", decode_step=decode_step)
    core = EngineCore(model, ModelShape(2, 2, 16, 512), config, eos_token_ids=frozenset({EOS}), device="cuda",
                      dtype=torch.float32)
    core.warm_decode_step()
    core.start()
    return EngineClient(core)


@pytest.mark.parametrize("decode_step", ["eager", "cuda-graph"])
def test_a_long_prompt_prefills_in_chunks_beside_decoding_rows(decode_step: str) -> None:
    client = cuda_engine(decode_step)
    short = Request("short", [5, 6, 7, 8], greedy(60), cache_prompt=False)
    long_prompt = [(i * 7) % 90 + 4 for i in range(300)]  # five chunks of 64: three sample nothing
    long = Request("long", long_prompt, greedy(20), cache_prompt=False)
    try:
        alone = [asyncio.run(collect(client, r))[0] for r in (short, long)]

        async def together() -> list[list[int]]:
            first = asyncio.create_task(collect(client, Request("short2", short.prompt_token_ids, short.sampling,
                                                                 cache_prompt=False)))
            await asyncio.sleep(0.05)  # the short request is decoding when the long one's chunks arrive
            second = await collect(client, Request("long2", long_prompt, long.sampling, cache_prompt=False))
            return [(await first)[0], second[0]]

        batched = asyncio.run(together())
    finally:
        client.core.stop(10)
    assert [len(t) for t in alone] == [60, 20]
    assert batched == alone
