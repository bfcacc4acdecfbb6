"""Engine behaviour end to end on a tiny random Llama (A3, L, M, N, F12).

Greedy outputs are compared bitwise with a no-cache reference: the engine computes the same
float32 operations per row; only the batch shape differs, which on CPU has not changed a
single greedy token in these tests (asserted exactly, so a difference would show).
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from mlxcel.config import EngineConfig
from mlxcel.engine.loop import EngineCore, ModelShape
from mlxcel.engine.kv.slot_files import SlotError
from mlxcel.engine.client import EngineClient
from mlxcel.types import (
    ContextOverflowError, EngineShutdownError, FinishReason, Priority, QueueFullError, Request, SamplingParams,
    TokenEvent,
)

from .conftest import EOS, collect, greedy, make_engine, reference_greedy, run

random.seed(1)
PROMPTS = [[random.randrange(4, 97) for _ in range(n)] for n in (3, 7, 12, 18, 25, 31, 40, 57)]


def wait_for(predicate, timeout: float = 20.0) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_alone_equals_reference(engine, tiny_model) -> None:
    tokens, last = run(collect(engine, Request("a", PROMPTS[3], greedy(10))))
    assert tokens == reference_greedy(tiny_model, PROMPTS[3], 10)
    assert last.finish_reason is FinishReason.LENGTH
    assert last.num_prompt_tokens == len(PROMPTS[3])


def test_batch_of_eight_mixed_lengths_equals_each_alone(engine, tiny_model) -> None:
    """A3: continuous batching; the 64-token step budget also chunks the longer prompts."""
    async def main():
        return await asyncio.gather(*(collect(engine, Request(f"r{i}", p, greedy(12))) for i, p in enumerate(PROMPTS)))
    results = run(main())
    for prompt, (tokens, _) in zip(PROMPTS, results):
        assert tokens == reference_greedy(tiny_model, prompt, 12)


def test_chunked_prefill_equals_reference(tiny_model) -> None:
    client = make_engine(tiny_model, max_num_batched_tokens=5)
    try:
        tokens, _ = run(collect(client, Request("c", PROMPTS[7], greedy(8))))
    finally:
        client.core.stop(10)
    assert tokens == reference_greedy(tiny_model, PROMPTS[7], 8)


def test_issue25_decode_rows_do_not_spend_the_prompt_budget(tiny_model) -> None:
    """--batch-size bounds a step's tokens, --ubatch-size its prompt tokens; decode rows count against the
    first only. (Both were one 512-token budget: 256 decode rows on a GPU left room for two 128-token
    prompts a step, and prefill steps took most of the engine's time.) A prompt that arrives while
    another request decodes still gets whole 16-token chunks, and both answers equal the references."""
    client = make_engine(tiny_model, max_num_batched_tokens=64, max_num_prefill_tokens=16)

    async def main() -> tuple[list[int], list[TokenEvent]]:
        decoding = client.generate(Request("a", PROMPTS[1], greedy(40)))
        first = await anext(decoding)  # "a" decodes from here on
        later = [event async for event in client.generate(Request("b", PROMPTS[7], greedy(3), report_progress=True))]
        rest = [token for event in [first, *[e async for e in decoding]] for token in event.token_ids]
        return rest, later

    try:
        a_tokens, b_events = run(main())
    finally:
        client.core.stop(10)
    assert [e.progress.processed for e in b_events if e.progress is not None] == [0, 16, 32, 48, 57]
    assert a_tokens == reference_greedy(tiny_model, PROMPTS[1], 40)
    assert [t for e in b_events for t in e.token_ids] == reference_greedy(tiny_model, PROMPTS[7], 3)


def test_report_progress_sends_one_event_per_prefill_chunk_before_the_tokens(tiny_model) -> None:
    """llama-server return_progress: a "0 %" event (processed == cache) before the first chunk, then one
    per chunk; `processed` counts the cached tokens too and ends at `total`."""
    client = make_engine(tiny_model, max_num_batched_tokens=16)

    async def events(request_id: str, report: bool) -> list[TokenEvent]:
        request = Request(request_id, PROMPTS[7], greedy(3), report_progress=report)
        return [event async for event in client.generate(request)]

    try:
        cold, warm, plain = run(events("cold", True)), run(events("warm", True)), run(events("plain", False))
    finally:
        client.core.stop(10)
    progress = [e.progress for e in cold if e.progress is not None]
    assert [p.processed for p in progress] == [0, 16, 32, 48, 57] and {p.total for p in progress} == {57}
    assert all(e.progress is not None and not e.token_ids for e in cold[:5]) and cold[5].token_ids
    assert [e.token_ids for e in cold[5:]] == [e.token_ids for e in plain]  # the tokens are unchanged
    warm_progress = [e.progress for e in warm if e.progress is not None]
    assert [(p.cache, p.processed) for p in warm_progress] == [(56, 56), (56, 57)]  # 0 %, the recomputed tail
    assert all(e.progress is None for e in plain)


def test_prefix_cache_hit_reports_cached_tokens_and_same_output(engine, tiny_model) -> None:
    prompt = PROMPTS[7]
    first, ev1 = run(collect(engine, Request("p1", prompt, greedy(6))))
    second, ev2 = run(collect(engine, Request("p2", prompt, greedy(6))))
    assert ev1.num_cached_tokens == 0
    assert ev2.num_cached_tokens == (len(prompt) - 1) // 4 * 4  # full blocks, last token recomputed
    assert first == second == reference_greedy(tiny_model, prompt, 6)
    stats = engine.stats().prefix_cache
    assert stats.num_hits == 1 and stats.num_reused_tokens == ev2.num_cached_tokens


def test_a_whole_prompt_hit_computes_only_the_last_token_and_leaves_the_cached_kv(engine, tiny_model) -> None:
    """Issue 11: a repeated prompt whose every block is cached hits the last block too; its last token
    goes through the decode step for logits only, so the shared blocks keep the prefill's bits."""
    prompt = PROMPTS[6]  # 40 tokens: 10 full blocks
    first, _ = run(collect(engine, Request("w1", prompt, greedy(6))))
    core = engine.core
    blocks, _ = core.call(lambda: core.scheduler.kv.find_cached_prefix(prompt, cache_prompt=True,
                                                                        include_last_block=True)).result()
    assert len(blocks) == len(prompt) // 4
    slots = torch.tensor([b * 4 + i for b in blocks for i in range(4)])
    before = [(k[slots].clone(), v[slots].clone()) for k, v in zip(core.runner.kv_cache.k, core.runner.kv_cache.v)]
    second, ev = run(collect(engine, Request("w2", prompt, greedy(6))))
    assert ev.num_cached_tokens == len(prompt) - 1
    assert first == second == reference_greedy(tiny_model, prompt, 6)
    for (k0, v0), k, v in zip(before, core.runner.kv_cache.k, core.runner.kv_cache.v):
        assert torch.equal(k[slots], k0) and torch.equal(v[slots], v0)


@pytest.mark.parametrize("length", [52, 53])
def test_issue25_a_prompts_partial_last_block_takes_the_decode_step_cold_chunked_and_after_a_hit(tiny_model,
                                                                                               length: int) -> None:
    """Issue 25 point 3: on the CPU the positions past a prompt's last whole block, when at most 4, go through the
    decode step as single-token rows, whichever way the prompt came: cold, in chunks, or after a prefix-cache hit
    (which covers whole blocks only); a longer tail stays in the prefill. Every way gives the reference's tokens."""
    prompt = PROMPTS[7][:length]  # 3 whole blocks of 16 and a tail of 4 (the decode step's) or 5 (the prefill's)

    def generate(engine: EngineClient, request_id: str) -> tuple[list[int], list[float], int, list[list[int]]]:
        """Tokens, their logprobs, the cached prompt tokens, and the positions of each decode step of several rows."""
        calls: list[list[int]] = []
        step = engine.core.runner.decode_step
        original = step.run
        step.run = lambda batch: (calls.append([r.position for r in batch]), original(batch))[1]  # type: ignore[method-assign]

        async def go() -> tuple[list[int], list[float], int]:
            tokens: list[int] = []
            logprobs: list[float] = []
            last = None
            async for event in engine.generate(Request(request_id, prompt, greedy(6, logprobs=0))):
                tokens.extend(event.token_ids)
                logprobs.extend(e.logprob for e in event.logprobs or ())
                last = event
            return tokens, logprobs, last.num_cached_tokens
        try:
            return *run(go()), [c for c in calls if len(c) > 1]
        finally:
            step.run = original  # type: ignore[method-assign]

    engine, chunking = make_engine(tiny_model, block_size=16), make_engine(tiny_model, block_size=16,
                                                                           max_num_batched_tokens=25)
    try:
        cold, hit = generate(engine, "cold"), generate(engine, "hit")
        chunked = generate(chunking, "chunked")  # chunks 0-24, 25-49, 50-52
    finally:
        engine.core.stop(10)
        chunking.core.stop(10)
    if length == 52:
        assert cold[3] == hit[3] == [list(range(48, 52))]
        assert chunked[3] == [[48, 49], [50, 51]]  # the tail cut where a chunk ends
    else:
        assert cold[3] == hit[3] == chunked[3] == []
    assert (cold[2], hit[2], chunked[2]) == (0, 48, 0)
    assert cold[0] == hit[0] == chunked[0] == reference_greedy(tiny_model, prompt, 6)
    if length == 52:  # the same bits, not only the argmax: the tail's 4 rows alike cold and after the hit
        assert cold[1] == hit[1]  # (this float32 model's eager matmuls sum 53 or 5 prefill rows, or 2 or 4
        # decode rows, each in its own order: the real model's kernels do not: test_prefix_hit_smollm2.py)


def test_cache_prompt_false_reads_nothing(engine) -> None:
    """M: cache_prompt false -> cold prefill, no read and no donation."""
    prompt = PROMPTS[6]
    run(collect(engine, Request("w", prompt, greedy(2), cache_prompt=False)))
    _, ev = run(collect(engine, Request("x", prompt, greedy(2), cache_prompt=False)))
    assert ev.num_cached_tokens == 0
    _, ev = run(collect(engine, Request("y", prompt, greedy(2))))
    assert ev.num_cached_tokens == 0  # nothing was donated by the two before


def test_preemption_under_kv_pressure_loses_nothing(tiny_model) -> None:
    # 8 slots share 24 blocks of 4 tokens: not all 8 sequences fit, so some are preempted.
    client = make_engine(tiny_model, ctx_size=8 * 32, max_num_batched_tokens=128)
    client.core.kv.pool.__init__(24, 4, enable_caching=True)  # shrink the pool below the slot total
    prompts = [p[:10] for p in PROMPTS]
    async def main():
        return await asyncio.gather(*(collect(client, Request(f"q{i}", p, greedy(8))) for i, p in enumerate(prompts)))
    try:
        results = run(main())
        assert client.core.kv.pool.num_free_blocks == 24
    finally:
        client.core.stop(10)
    for prompt, (tokens, last) in zip(prompts, results):
        assert tokens == reference_greedy(tiny_model, prompt, 8)
        assert last.finish_reason is FinishReason.LENGTH


def test_abort_frees_all_blocks(engine) -> None:
    async def main():
        stream = engine.submit(Request("long", PROMPTS[5], greedy(200)))
        async for _ in stream:
            break
        await stream.aclose()
        await engine.call(lambda: None)  # one loop turn later the abort is done
    run(main())
    assert engine.core.kv.pool.num_free_blocks == engine.core.kv.pool.num_blocks
    assert engine.stats().active_sequences == 0


def test_priorities_order_the_waiting_queue(tiny_model) -> None:
    """L: with one slot busy, a high-priority request is served before earlier low ones."""
    client = make_engine(tiny_model, max_num_seqs=1)
    order: list[str] = []
    async def one(rid, prio):
        await collect(client, Request(rid, PROMPTS[0], greedy(3), priority=prio))
        order.append(rid)
    async def main():
        blocker = asyncio.create_task(one("busy", Priority.NORMAL))
        await asyncio.sleep(0.05)
        tasks = [asyncio.create_task(one(r, p)) for r, p in
                 (("low1", Priority.LOW), ("low2", Priority.LOW), ("high", Priority.HIGH))]
        await asyncio.gather(blocker, *tasks)
    try:
        client.core.call(lambda: __import__("time").sleep(0.2))  # hold the loop so all queue up
        run(main())
    finally:
        client.core.stop(10)
    assert order.index("high") < order.index("low1") < order.index("low2")


def test_queue_full_and_context_overflow_are_distinct_errors(tiny_model) -> None:
    client = make_engine(tiny_model, max_num_seqs=2, max_queue_depth=1, ctx_size=8 * 32)
    try:
        with pytest.raises(ContextOverflowError):
            client.core.submit(Request("big", [5] * 140, greedy(1)), lambda e: None)
        client.core.call(lambda: __import__("time").sleep(0.3))
        for i in range(3):  # 2 slots + 1 waiting place, all still in the inbox
            client.core.submit(Request(f"r{i}", [5, 6], greedy(1)), lambda e: None)
        with pytest.raises(QueueFullError):
            client.core.submit(Request("over", [5, 6], greedy(1)), lambda e: None)
    finally:
        client.core.stop(10)


def test_admission_does_not_depend_on_loop_timing(tiny_model) -> None:
    """Issue 16: --parallel 1 --max-queue-depth 2 admits 1 running + 2 waiting, whether or not the
    loop has moved the first request into its slot yet (the old check counted it as waiting)."""
    client = make_engine(tiny_model, max_num_seqs=1, max_queue_depth=2)
    try:
        for burst in range(20):
            if burst % 2:
                client.core.call(lambda: __import__("time").sleep(0.05))  # the loop busy: all in the inbox
            events: list[TokenEvent] = []
            for i in range(3):
                client.core.submit(Request(f"b{burst}-{i}", [5, 6], greedy(2)), events.append)
            with pytest.raises(QueueFullError):
                client.core.submit(Request(f"b{burst}-x", [5, 6], greedy(2)), events.append)
            wait_for(lambda: sum(e.finish_reason is not None for e in events) == 3)
    finally:
        client.core.stop(10)


def test_a_request_that_breaks_sampling_fails_alone_and_the_loop_lives(tiny_model) -> None:
    """Issue 16: an exception in one request (a seed torch refuses, a processor that raises) fails
    that request with an error event; the others in the same batch finish and the engine serves on."""
    client = make_engine(tiny_model)

    class Broken:
        def process(self, logits, output_ids) -> None:
            raise RuntimeError("injected fault")

    try:
        bad_seed = Request("seed", [5, 6], SamplingParams(temperature=1.0, seed=2**70, max_tokens=2))
        broken = Request("broken", [5, 6, 7], greedy(4), processors=(Broken(),))
        good = Request("good", [5, 6, 7], greedy(4))
        events: list[TokenEvent] = []
        for request in (bad_seed, broken, good):
            client.core.submit(request, events.append)
        wait_for(lambda: sum(e.finish_reason is not None for e in events) == 3)
        finish = {e.request_id: e.finish_reason for e in events if e.finish_reason is not None}
        assert finish["seed"] is FinishReason.ERROR and finish["broken"] is FinishReason.ERROR
        assert finish["good"] in (FinishReason.LENGTH, FinishReason.STOP)
        assert client.core.is_alive and client.core.stats().is_alive
        tokens, _ = run(collect(client, Request("after", [5, 6], greedy(3))))
        assert len(tokens) == 3
        stats = client.core.stats()
        assert stats.sequences_started == stats.sequences_completed + stats.sequences_aborted + stats.active_sequences
    finally:
        client.core.stop(10)


def test_a_dead_loop_fails_everything_and_refuses_new_work(tiny_model) -> None:
    """Issue 16: if the loop thread dies anyway, in-flight requests get an error event, is_alive turns
    False (health 503) and submit refuses at once instead of queueing forever."""
    client = make_engine(tiny_model)
    try:
        events: list[TokenEvent] = []
        client.core.submit(Request("victim", [5, 6], greedy(50)), events.append)
        wait_for(lambda: bool(events))

        def die() -> None:
            raise SystemExit("injected")  # not an Exception: the loop's own guards do not contain it

        client.core.scheduler.schedule = die  # type: ignore[method-assign]
        wait_for(lambda: not client.core.is_alive)
        wait_for(lambda: any(e.finish_reason is FinishReason.ERROR for e in events))
        assert not client.core.stats().is_alive
        with pytest.raises(EngineShutdownError):
            client.core.submit(Request("late", [5, 6], greedy(1)), events.append)
    finally:
        client.core.stop(10)


def test_max_kv_size_keeps_positions_exact(tiny_model) -> None:
    """N: with a window larger than the sequence, output equals the unbounded run."""
    client = make_engine(tiny_model, max_kv_size=64)
    try:
        tokens, _ = run(collect(client, Request("n", PROMPTS[4], greedy(20))))
        long_tokens, _ = run(collect(client, Request("n2", PROMPTS[7], greedy(30))))
    finally:
        client.core.stop(10)
    assert tokens == reference_greedy(tiny_model, PROMPTS[4], 20)
    assert len(long_tokens) == 30  # ran past the window: the oldest blocks were released


def test_seeded_sampling_is_independent_of_the_batch(engine) -> None:
    params = SamplingParams(temperature=0.9, top_k=20, seed=1234, max_tokens=10, ignore_eos=True)
    alone, _ = run(collect(engine, Request("s1", PROMPTS[2], params)))
    async def main():
        noise = [collect(engine, Request(f"n{i}", p, SamplingParams(temperature=1.0, max_tokens=10)))
                 for i, p in enumerate(PROMPTS[:5])]
        return await asyncio.gather(collect(engine, Request("s2", PROMPTS[2], params)), *noise)
    batched = run(main())[0][0]
    assert alone == batched


def test_slot_save_restore_erase(tiny_model, tmp_path) -> None:
    """F12: a saved slot restored into a fresh engine gives a prefix-cache hit."""
    client = make_engine(tiny_model, slot_save_path=str(tmp_path), max_num_seqs=2)
    prompt = PROMPTS[7]
    try:
        run(collect(client, Request("a", prompt, greedy(4), slot_id=1)))
        saved = run(client.save_slot(1, "s1.bin"))
        assert saved.num_tokens >= 56 and (tmp_path / "s1.bin").is_file()
        with pytest.raises(SlotError):
            run(client.save_slot(1, "../escape"))
    finally:
        client.core.stop(10)
    fresh = make_engine(tiny_model, slot_save_path=str(tmp_path), max_num_seqs=2)
    try:
        restored = run(fresh.restore_slot(0, "s1.bin"))
        assert restored.num_tokens == saved.num_tokens
        tokens, ev = run(collect(fresh, Request("b", prompt, greedy(4))))
        assert ev.num_cached_tokens == (len(prompt) - 1) // 4 * 4  # every full prompt block hit
        assert tokens == reference_greedy(tiny_model, prompt, 4)
        assert run(fresh.erase_slot(0)) == saved.num_tokens
        _, ev = run(collect(fresh, Request("c", prompt[:40] + [9, 9, 9], greedy(1))))
        assert ev.num_cached_tokens == 0
    finally:
        fresh.core.stop(10)


@pytest.mark.skipif(not __import__("mlxcel.layers.quant", fromlist=["x"]).can_quantize(), reason="no int8 kernel")
def test_quantized_cpu_path_gives_the_same_tokens_alone_and_batched(tiny_model) -> None:
    """The default CPU path picks int8 or bfloat16 per row kind, not per step (layers/quant.py),
    so a request's tokens do not depend on what else is in its batch."""
    import copy

    from mlxcel.layers.quant import quantize

    model = copy.deepcopy(tiny_model)
    quantize(model)
    client = make_engine(model)
    async def batch():
        return await asyncio.gather(*(collect(client, Request(f"b{i}", p, greedy(12))) for i, p in enumerate(PROMPTS)))
    try:
        alone = [run(collect(client, Request(f"a{i}", p, greedy(12))))[0] for i, p in enumerate(PROMPTS)]
        together = [tokens for tokens, _ in run(batch())]
    finally:
        client.core.stop(10)
    assert together == alone


def test_kv_memory_budget_caps_the_pool_and_still_serves_every_request(tiny_model) -> None:
    """A3: the pool is sized from --ctx-size, or capped by a memory budget; a pool smaller than
    every slot's full context shares blocks and preempts under pressure, losing nothing."""
    from mlxcel.config import EngineConfig

    bytes_per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, float32
    config = EngineConfig(max_num_seqs=8, ctx_size=8 * 64, block_size=4, kv_cache_bytes=30 * 4 * bytes_per_token)
    assert config.num_blocks(512, bytes_per_token) == 30  # instead of 8 * (64 / 4 + 1) = 136
    with pytest.raises(ValueError, match="kv-cache-memory"):
        EngineConfig(ctx_size=8 * 64, max_num_seqs=8, block_size=4, kv_cache_bytes=100).num_blocks(512, bytes_per_token)
    client = make_engine(tiny_model, ctx_size=8 * 64, kv_cache_bytes=30 * 4 * bytes_per_token)
    prompts = [p[:20] for p in PROMPTS]
    async def main():
        return await asyncio.gather(*(collect(client, Request(f"m{i}", p, greedy(10))) for i, p in enumerate(prompts)))
    try:
        assert client.core.kv.pool.num_blocks == 30
        results = run(main())
        assert client.core.kv.pool.num_free_blocks == 30
    finally:
        client.core.stop(10)
    for prompt, (tokens, _) in zip(prompts, results):
        assert tokens == reference_greedy(tiny_model, prompt, 10)


def test_models_with_their_own_sliding_window_ignore_max_kv_size() -> None:
    """N: --max-kv-size is dropped (with a log line) for a model that has a sliding window."""
    import torch

    from mlxcel.config import EngineConfig
    from mlxcel.loading import LoadedModel
    from mlxcel.models import gemma3, llama
    from mlxcel.serving.served_model import _fit_engine_config

    config = EngineConfig(max_kv_size=128)
    with torch.device("meta"):
        windowed = gemma3.Model(gemma3.ModelArgs.from_dict(dict(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=96, vocab_size=50, sliding_window=8, query_pre_attn_scalar=16)))
        plain = llama.Model(llama.ModelArgs(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=96, vocab_size=50))
    assert _fit_engine_config(LoadedModel(windowed, {"model_type": "gemma3"}, None, None, None), config).max_kv_size == 0
    assert _fit_engine_config(LoadedModel(plain, {"model_type": "llama"}, None, None, None), config).max_kv_size == 128


def test_events_handed_over_a_step_late_lose_nothing_and_keep_their_order(tiny_model) -> None:
    """Issue 11 (GPU): with deferred events (the CUDA default: a step's events go out once the next
    step is launched) every request's sink still gets all its tokens, in order, then exactly one
    finish and nothing after it; an abort mid-stream is the last event of its request; the pool
    is whole afterwards."""
    config = EngineConfig(max_num_seqs=8, ctx_size=8 * 128, max_num_batched_tokens=64, block_size=4,
                          cache_type_k="f32", cache_type_v="f32")
    core = EngineCore(tiny_model, ModelShape(2, 2, 16, 512), config, eos_token_ids=frozenset({EOS}),
                      defer_events=True)
    events: dict[str, list[TokenEvent]] = {}
    core.start()
    try:
        core.submit(Request("cut", PROMPTS[5], greedy(200)), events.setdefault("cut", []).append)
        for i, prompt in enumerate(PROMPTS):
            core.submit(Request(f"d{i}", prompt, greedy(12)), events.setdefault(f"d{i}", []).append)
        wait_for(lambda: sum(len(e.token_ids) for e in events["cut"]) >= 3)
        core.abort("cut")
        wait_for(lambda: all(e and e[-1].finish_reason is not None for e in events.values()))
        wait_for(lambda: core.stats().active_sequences == 0)
        time.sleep(0.2)  # anything still queued would arrive now
        assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks
    finally:
        core.stop(10)
    assert [e.finish_reason for e in events["cut"] if e.finish_reason] == [FinishReason.ABORT]
    assert events["cut"][-1].finish_reason is FinishReason.ABORT
    for i, prompt in enumerate(PROMPTS):
        got = events[f"d{i}"]
        assert [n for n, e in enumerate(got) if e.finish_reason is not None] == [len(got) - 1]
        assert [t for e in got for t in e.token_ids] == reference_greedy(tiny_model, prompt, 12)
