"""Token processors inside the real engine (V, R, P): a constrained request, a budgeted one and
a free one share batches; each gets its own behaviour and the free one is untouched.

A tiny random Llama over the tiny byte-level vocabulary (which has `<think>`/`</think>`)
plays the model; nothing about it knows the grammar, so only the processors can make the
outputs right.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import pytest
import torch

from mlxcel.config import EngineConfig
from mlxcel.engine.client import EngineClient
from mlxcel.engine.loop import EngineCore, ModelShape
from mlxcel.models import llama
from mlxcel.chat.budget import ReasoningBudget
from mlxcel.chat.grammar import GrammarCompiler
from mlxcel.chat.loop_guard import LoopGuard, LoopPolicy
from mlxcel.chat.reasoning import infer_think_tokens
from mlxcel.text.tokenizer import Tokenizer
from mlxcel.types import FinishReason, Request, SamplingParams, TokenEvent, TokenProcessor
from tests.chat.drive import single_thread  # noqa: F401 - autouse fixture


@pytest.fixture(scope="module")
def engine(byte_level_tokenizer: Tokenizer) -> Iterator[EngineClient]:
    torch.manual_seed(0)
    args = llama.ModelArgs(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, vocab_size=byte_level_tokenizer.vocab_size + 11,
                           max_position_embeddings=512, tie_word_embeddings=True)
    model = llama.Model(args)
    for p in model.parameters():  # larger weights: varied, non-degenerate greedy outputs
        torch.nn.init.normal_(p, std=0.3)
    model.eval()
    config = EngineConfig(max_num_seqs=4, ctx_size=4 * 128, max_num_batched_tokens=64, block_size=4)
    core = EngineCore(model, ModelShape(2, 2, 16, 512), config, eos_token_ids=byte_level_tokenizer.eos_token_ids)
    core.start()
    yield EngineClient(core)
    core.stop(10)


async def run(client: EngineClient, request: Request) -> tuple[list[int], FinishReason | None]:
    tokens: list[int] = []
    last: TokenEvent | None = None
    async for event in client.generate(request):
        tokens.extend(event.token_ids)
        last = event
    return tokens, last.finish_reason if last else None


def request(request_id: str, processors: tuple[TokenProcessor, ...], *, temperature: float = 0.8,
            max_tokens: int = 40) -> Request:
    sampling = SamplingParams(temperature=temperature, seed=7, max_tokens=max_tokens)
    return Request(request_id, [5, 6, 7, 8], sampling, processors=processors)


async def run_together(client: EngineClient, requests: list[Request]) -> list[tuple[list[int], FinishReason | None]]:
    return list(await asyncio.gather(*(run(client, r) for r in requests)))


def test_v_r_constrained_budgeted_and_free_requests_share_the_engine(
    engine: EngineClient, byte_level_tokenizer: Tokenizer
) -> None:
    tokenizer = byte_level_tokenizer
    think = infer_think_tokens(tokenizer)
    assert think is not None
    compiler = GrammarCompiler(tokenizer)
    grammar = compiler.regex(r"(hello|world) [0-9]{2}\.")
    free = request("free", (), temperature=0.0, max_tokens=12)
    alone, _ = asyncio.run(run(engine, free))
    results = asyncio.run(run_together(engine, [
        request("grammar", (compiler.processor(grammar),)),
        request("budget", (ReasoningBudget(think, 3, starts_in_reasoning=True),), max_tokens=10),
        request("free", (), temperature=0.0, max_tokens=12),
    ]))  # fmt: skip
    (constrained, reason), (budgeted, _), (together, _) = results
    assert re.fullmatch(r"(hello|world) [0-9]{2}\.", tokenizer.decode(constrained)), tokenizer.decode(constrained)
    assert reason is FinishReason.STOP
    assert budgeted[3] == think.end_ids[0]  # three reasoning tokens, then the forced end marker
    assert together == alone  # a free request is untouched by its neighbours' processors


def test_p_loop_guard_ends_a_repeating_generation_in_the_engine(engine: EngineClient) -> None:
    # Greedy decoding of a tiny random model falls into a cycle; the guard stops it with LOOP.
    guard = LoopGuard(LoopPolicy(max_pattern_size=20, min_pattern_size=1, min_count=3))
    tokens, reason = asyncio.run(run(engine, request("loop", (guard,), temperature=0.0, max_tokens=400)))
    assert reason is FinishReason.LOOP
    assert len(tokens) < 400
