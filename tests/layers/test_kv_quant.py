"""Quantized KV cache element types (spec N2, issue 11 point 5): q8_0 and turbo4.

Codes round-trip within their step; the turn of turbo4 is orthogonal; a tiny model decoding over a
quantized cache stays close to the dense cache, on the eager and the compiled step, alone and in a
batch; the engine serves with them and sizes its pool by their bytes.
"""

from __future__ import annotations

import pytest
import torch

from mlxcel.config import EngineConfig
from mlxcel.engine.decode_step import DecodeRow, DecodeStep
from mlxcel.engine.kv.tensors import KVCache
from mlxcel.engine.loop import EngineCore, ModelShape
from mlxcel.layers import kv_quant
from mlxcel.layers.attention import AttentionContext, SequenceSlice
from mlxcel.models import llama
from tests.engine.conftest import random_llama

BLOCK = 4
HEAD_DIM = 32


@pytest.fixture(scope="module")
def model() -> llama.Model:
    return random_llama(3, hidden_size=128, std=0.2)


@pytest.mark.parametrize("element", kv_quant.QUANTIZED_TYPES)
def test_n2_codes_round_trip_within_half_a_step(element: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 3, 64) * torch.linspace(0.1, 4, 64)  # channels of very different size
    codes, scales = kv_quant.encode(element, x)
    assert codes.dtype == kv_quant.storage_dtype(element)
    assert codes.shape[-1] == kv_quant.storage_dim(element, 64) and scales.shape == (5, 3, 2)
    back = kv_quant.decode(element, codes, scales, torch.float32)
    step = scales.float().repeat_interleave(kv_quant.QBLOCK, dim=-1)
    assert ((back - x).abs() <= step / 2 + 1e-3 * step).all()


def test_n2_turbo_turn_is_orthogonal_and_spreads_an_outlier() -> None:
    turn = kv_quant.Rotation(64, "cpu")
    assert torch.allclose(turn.matrix @ turn.matrix.T, torch.eye(64), atol=1e-5)
    spike = torch.zeros(64)
    spike[7] = 10.0
    turned = turn.turn(spike)
    assert torch.allclose(turn.turn_back(turned), spike, atol=1e-5)
    assert turned.abs().max() < 2.0  # one large channel becomes 64 small ones (10 / sqrt(64) each)


def _prefill_then_decode(model: llama.Model, cache: KVCache, mode: str, prompts: list[list[int]]) -> torch.Tensor:
    """Each prompt but its last token prefilled into its own blocks, then one decode step for all."""
    step = DecodeStep(model, cache, "cpu", mode=mode, max_rows=8, max_positions=512)
    rows = []
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            table = tuple(range(i * 16, (i + 1) * 16))
            n = len(prompt) - 1
            ctx = AttentionContext([SequenceSlice(0, n, n, block_table=table)], cache, prefill_only=True)
            model(torch.tensor(prompt[:n]), torch.arange(n), ctx)
            rows.append(DecodeRow(prompt[n], n, 0, table))
        return step.run(rows)


PROMPTS = [[5, 9, 14, 3, 77, 21, 8, 40, 2, 61, 19], [33, 4, 90, 12], list(range(10, 50))]


# Max logit error as a share of the logits' span; measured here: q8_0 0.6 %, turbo4 12 %.
@pytest.mark.parametrize("element,tolerance", [("q8_0", 0.02), ("turbo4", 0.2)])
@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_n2_decode_over_a_quantized_cache_stays_close_to_dense(model: llama.Model, element: str,
                                                               tolerance: float, mode: str) -> None:
    dense = _prefill_then_decode(model, KVCache(2, 64, BLOCK, 2, HEAD_DIM, torch.float32, "cpu"), mode, PROMPTS)
    cache = KVCache(2, 64, BLOCK, 2, HEAD_DIM, torch.float32, "cpu", k_type=element, v_type=element)
    assert cache.k_scales is not None and cache.k[0].dtype == kv_quant.storage_dtype(element)
    quantized = _prefill_then_decode(model, cache, mode, PROMPTS)
    error = float((quantized - dense).abs().max()) / float(dense.abs().max())
    print(f"{element} {mode}: max |logit - dense| = {100 * error:.1f} % of the logits' span")
    assert error < tolerance
    if element == "q8_0":  # 4 bits may flip this random model's near ties
        assert torch.equal(quantized.argmax(-1), dense.argmax(-1))


@pytest.mark.parametrize("element", kv_quant.QUANTIZED_TYPES)
def test_n2_a_row_gets_the_same_bits_alone_and_batched_over_a_quantized_cache(model: llama.Model,
                                                                              element: str) -> None:
    cache = KVCache(2, 64, BLOCK, 2, HEAD_DIM, torch.float32, "cpu", k_type=element, v_type=element)
    together = _prefill_then_decode(model, cache, "compile", PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        alone_cache = KVCache(2, 64, BLOCK, 2, HEAD_DIM, torch.float32, "cpu", k_type=element, v_type=element)
        alone = _prefill_then_decode(model, alone_cache, "compile", [[0, 0]] * i + [prompt])
        assert torch.equal(alone[i], together[i])


def test_n2_engine_sizes_its_pool_by_the_element_bytes_and_ignores_max_kv_size_under_turbo(
        model: llama.Model, caplog: pytest.LogCaptureFixture) -> None:
    shape = ModelShape(2, 2, HEAD_DIM, 512)
    budget = 300_000  # below what the context alone asks for (2 slots of 512), so the bytes decide

    def pool(**settings: object) -> EngineCore:
        config = EngineConfig(max_num_seqs=2, ctx_size=1024, block_size=BLOCK, kv_cache_bytes=budget, **settings)
        return EngineCore(model, shape, config, eos_token_ids=frozenset())

    bf16, q8, turbo = pool(), pool(cache_type_k="q8_0", cache_type_v="q8_0"), pool(kv_quant_scheme="turboquant")
    assert bf16.kv_cache.bytes_per_token == 2 * 2 * HEAD_DIM * 2 * 2
    assert q8.kv_cache.bytes_per_token == 2 * 2 * HEAD_DIM * 2 * (1 + 2 / 32)
    assert turbo.kv_cache.k_type == turbo.kv_cache.v_type == "turbo4"
    assert turbo.kv.pool.num_blocks >= q8.kv.pool.num_blocks > bf16.kv.pool.num_blocks  # q8_0: capped by context
    with caplog.at_level("WARNING"):
        capped = pool(kv_cache_mode="turbo4", max_kv_size=256)
    assert capped.config.max_kv_size == 0
    assert "--max-kv-size 256 is ignored" in caplog.text


def test_n2_unknown_modes_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="--kv-cache-mode must be one of default, turbo4; not 'turbo9'"):
        EngineConfig(kv_cache_mode="turbo9")
    with pytest.raises(ValueError, match="--cache-type-k must be one of f32, bf16, f16, q8_0; not 'q4_0'"):
        EngineConfig(cache_type_k="q4_0")


def test_n2_a_saved_slot_keeps_its_scales_and_a_mismatched_type_is_refused(model: llama.Model, tmp_path) -> None:
    """F12 with a q8_0 cache: restored into a fresh q8_0 engine, the prompt is a cache hit with the
    same next tokens; a bf16 engine refuses the file, naming both types."""
    import asyncio

    from mlxcel.engine.client import EngineClient
    from mlxcel.engine.kv.slot_files import SlotError
    from mlxcel.types import Request, SamplingParams

    def engine(**settings: object) -> EngineClient:
        config = EngineConfig(max_num_seqs=2, ctx_size=1024, block_size=BLOCK, slot_save_path=str(tmp_path),
                              **settings)
        core = EngineCore(model, ModelShape(2, 2, HEAD_DIM, 512), config, eos_token_ids=frozenset())
        core.start()
        return EngineClient(core)

    async def generate(client: EngineClient, request_id: str, prompt: list[int], **fields: object) -> tuple:
        tokens, last = [], None
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        async for event in client.generate(Request(request_id, prompt, params, **fields)):
            tokens += event.token_ids
            last = event
        return tokens, last

    prompt = list(range(20, 60))
    q8 = {"cache_type_k": "q8_0", "cache_type_v": "q8_0"}
    first = engine(**q8)
    try:
        tokens, _ = asyncio.run(generate(first, "a", prompt, slot_id=1))
        saved = asyncio.run(first.save_slot(1, "q8.bin"))
    finally:
        first.core.stop(10)
    fresh = engine(**q8)
    try:
        assert asyncio.run(fresh.restore_slot(0, "q8.bin")).num_tokens == saved.num_tokens
        again, last = asyncio.run(generate(fresh, "b", prompt))
        # 40 tokens = 10 whole blocks: a whole-prompt hit, whose last token alone is computed (issue 11)
        assert last.num_cached_tokens == len(prompt) - 1 and again == tokens
    finally:
        fresh.core.stop(10)
    dense = engine()
    try:
        with pytest.raises(SlotError, match="saved with KV cache types q8_0/q8_0, the server runs bf16/bf16"):
            asyncio.run(dense.restore_slot(0, "q8.bin"))
    finally:
        dense.core.stop(10)
