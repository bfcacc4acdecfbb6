"""Issue 41: hybrid recurrent families (Qwen3-Next, Qwen3.5 dense and MoE: Gated DeltaNet + gated attention)
from tiny random checkpoints transformers writes, and their recurrent state in the engine.

- logits equal transformers' float32 forward (prompts past the delta rule's 64-position chunk too);
- the layer over a state store: a prompt prefilled in pieces, then decoded, equals one piece;
- through the real engine: 16 greedy tokens equal transformers', alone and batched; a chunked prefill
  gives the one-piece run's tokens and logprobs; a prefix-cache hit resumes from a state snapshot with
  the cold run's tokens and logprob bits; drafts that are partly rejected roll the state back and leave
  the greedy tokens; aborts and preemptions among 64 streams leave no state slot held.
"""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path

import pytest
import torch
import transformers

from mlxcel.config import EngineConfig, SpeculativeConfig
from mlxcel.engine.client import EngineClient
from mlxcel.engine.kv.tensors import KVCache
from mlxcel.engine.loop import EngineCore, ModelShape
from mlxcel.engine.spec import DraftPolicy
from mlxcel.layers.attention import AttentionContext, SequenceSlice
from mlxcel.layers.recurrent import RecurrentStates, StateTensors, state_specs
from mlxcel.loading import load_model
from mlxcel.types import Request, SamplingParams

from .harness import batch_uncached_logits, save_tiny_hf, uncached_logits

VOCAB = 128
TOL_VS_TRANSFORMERS = 2e-5
TOL_SAME_MATH = 1e-5
# A piece that ends inside the delta rule's 64-position chunk sums that chunk in another order (seen: 1.1e-5 on
# logits of ~5; 5.6e-5 on one of 8,960 with MoE layers after it).
TOL_PIECES = 1e-4
NUM_TOKENS = 16
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
             layer_types=["linear_attention", "full_attention"])
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
HYBRIDS = {
    "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(**SMALL),
    "qwen3_5_moe_text": lambda: transformers.Qwen3_5MoeTextConfig(**SMALL, **MOE),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(**SMALL, **MOE),
}
_rng = random.Random(3)
PROMPTS = [[_rng.randrange(1, VOCAB) for _ in range(n)] for n in (5, 9, 14, 23)]
LONG = [_rng.randrange(1, VOCAB) for _ in range(70)]


@pytest.fixture(scope="module", params=list(HYBRIDS))
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp(request.param)
    reference = save_tiny_hf(HYBRIDS[request.param](), folder)
    loaded = load_model(folder)
    assert loaded.model_type == request.param
    return reference, loaded.model


@torch.inference_mode()
def _reference_logits(reference: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return reference(torch.tensor([ids])).logits[0]


_GREEDY: dict[tuple[int, tuple[int, ...]], list[int]] = {}


@torch.inference_mode()
def _transformers_greedy(reference: torch.nn.Module, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation (its own generate: chunked prefill, then its recurrent decode form)."""
    key = (id(reference), tuple(prompt))
    if key not in _GREEDY:
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                                 do_sample=False)
        _GREEDY[key] = out[0, len(prompt):].tolist()
    return _GREEDY[key]


def test_issue41_logits_equal_transformers(hybrid) -> None:
    reference, ours = hybrid
    for prompt in [PROMPTS[0], PROMPTS[3], LONG]:
        torch.testing.assert_close(uncached_logits(ours, prompt), _reference_logits(reference, prompt),
                                   atol=TOL_VS_TRANSFORMERS, rtol=0)
    batched = batch_uncached_logits(ours, PROMPTS)  # each sequence of a step starts from its own zero state
    for got, prompt in zip(batched, PROMPTS):
        torch.testing.assert_close(got, uncached_logits(ours, prompt), atol=TOL_SAME_MATH, rtol=0)


@torch.inference_mode()
def test_issue41_pieces_over_a_state_store_equal_one_piece(hybrid) -> None:
    """Prefill 40 + 27 positions (the first piece ends inside a 64-position chunk), then 3 decode steps, two
    sequences side by side in every step: each position's logits equal the whole prompt's forward."""
    _, model = hybrid
    args = model.args
    kv = KVCache(args.num_hidden_layers, 64, 4, args.kv_heads, args.dim_per_head, torch.float32, "cpu")
    store = StateTensors(state_specs(model), 4, torch.float32, "cpu")
    prompts = [LONG, list(reversed(LONG))]
    tables = {0: tuple(range(0, 20)), 1: tuple(range(20, 40))}
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    done = 0
    for size in (40, 27, 1, 1, 1):
        ids, pos, slices = [], [], []
        for seq, prompt in enumerate(prompts):
            slices.append(SequenceSlice(len(ids), size, done + size, block_table=tables[seq]))
            ids += prompt[done:done + size]
            pos += range(done, done + size)
        reads = [0, 0] if done == 0 else [1, 2]
        states = RecurrentStates(store, [s.q_start for s in slices], [size, size], reads, [1, 2])
        ctx = AttentionContext(slices, kv, "cpu", states=states)
        logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(pos), ctx))
        for seq, sl in enumerate(slices):
            got[seq].append(logits[sl.q_start:sl.q_start + sl.q_len])
        done += size
    for seq, prompt in enumerate(prompts):
        torch.testing.assert_close(torch.cat(got[seq]), uncached_logits(model, prompt), atol=TOL_PIECES, rtol=0)


# ---- through the engine ----

def _engine(model: torch.nn.Module, drafts: DraftPolicy | None = None, **overrides: object) -> EngineClient:
    config = EngineConfig(**{"max_num_seqs": 4, "ctx_size": 4 * 64, "max_num_batched_tokens": 32, "block_size": 4,
                             "cache_type_k": "f32", "cache_type_v": "f32", **overrides})
    core = EngineCore(model, ModelShape.of(model.args), config, eos_token_ids=frozenset(), drafts=drafts,
                      cache_identity=f"tiny-{model.args.__class__.__module__}")
    core.start()
    return EngineClient(core)


async def _generate(client: EngineClient, request_id: str, prompt: list[int],
                    num_tokens: int = NUM_TOKENS) -> tuple[list[int], list[float], int]:
    tokens, logprobs, cached = [], [], 0
    sampling = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, logprobs=0)
    async for event in client.generate(Request(request_id, prompt, sampling)):
        tokens.extend(event.token_ids)
        logprobs.extend(lp.logprob for lp in event.logprobs or ())
        cached = event.num_cached_tokens or cached
    return tokens, logprobs, cached


def _state_pool_bytes(model: torch.nn.Module, **overrides: object) -> int:
    """The recurrent-state pool's bytes of an engine of this config (--kv-cache-memory holds it beside the blocks)."""
    client = _engine(model, **overrides)
    client.core.stop(10)
    return client.core.states.num_bytes


def _assert_no_state_held(client: EngineClient) -> None:
    pool = client.core.states
    assert pool._holds == {} and pool._hashes == {} and not client.core.scheduler.running


def test_issue41_engine_greedy_alone_batched_and_after_a_snapshot_resume(hybrid) -> None:
    reference, model = hybrid
    expected = [_transformers_greedy(reference, p) for p in PROMPTS]
    client = _engine(model)
    try:
        assert len(client.core.kv_cache.k) == 1  # KV for the attention layer only, none for the recurrent one
        cold = asyncio.run(_generate(client, "cold", PROMPTS[-1]))
        assert cold[0] == expected[-1] and cold[2] == 0
        # The same prompt again resumes from the snapshot at its last whole block (20 of 23 tokens): the
        # cold run's tokens and logprob bits (both computed positions 20.. alone in their steps).
        warm = asyncio.run(_generate(client, "warm", PROMPTS[-1]))
        assert warm == (cold[0], cold[1], 20)
        assert client.core.states.num_resumed == 1
        batched = asyncio.run(_gather(client, "batch", PROMPTS))
        assert [t for t, _, _ in batched] == expected
        again = asyncio.run(_gather(client, "again", PROMPTS))  # each resumes beside the others
        assert [t for t, _, _ in again] == expected
        assert [c for _, _, c in again] == [(len(p) - 1) // 4 * 4 for p in PROMPTS]
        _assert_no_state_held(client)
    finally:
        client.core.stop(10)


async def _gather(client: EngineClient, tag: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float], int]]:
    return list(await asyncio.gather(*(_generate(client, f"{tag}{i}", p) for i, p in enumerate(prompts))))


@pytest.mark.parametrize("hybrid", ["qwen3_5_text"], indirect=True)  # the engine paths are the families' same
def test_issue41_chunked_prefill_equals_one_piece(hybrid) -> None:
    """A 70-token prompt in steps of 8 tokens (chunks that end inside blocks and inside the delta rule's
    64-position chunk) gives the one-step run's tokens and logprobs."""
    _, model = hybrid
    results = []
    for budget in (8, 128):
        client = _engine(model, max_num_batched_tokens=budget, max_num_prefill_tokens=budget, ctx_size=4 * 128,
                         enable_prefix_caching=False)
        try:
            results.append(asyncio.run(_generate(client, "long", LONG)))
        finally:
            client.core.stop(10)
    (tokens_8, logprobs_8, _), (tokens_all, logprobs_all, _) = results
    assert tokens_8 == tokens_all
    assert logprobs_8 == pytest.approx(logprobs_all, abs=1e-4)


class _ScriptedDrafter:
    """Drafts the next three greedy tokens with the third one wrong: every verify row accepts two and
    rejects one, so the state after the rejected position must be rolled back."""

    kind = "scripted"

    def __init__(self, prompt: list[int], continuation: list[int]) -> None:
        self.text = prompt + continuation

    def propose(self, seq, max_len: int) -> tuple[int, ...]:  # noqa: ANN001 - the spec.Sequence protocol
        at = len(seq.token_ids)
        draft = list(self.text[at:at + min(3, max_len)])
        if len(draft) == 3:
            draft[2] = (draft[2] + 1) % VOCAB
        return tuple(draft)

    def free(self, request_id: str) -> None:
        return None


def test_issue41_rejected_drafts_roll_the_state_back(hybrid) -> None:
    reference, model = hybrid
    prompt = PROMPTS[2]
    expected = _transformers_greedy(reference, prompt)
    spec = SpeculativeConfig(draft_kind="prompt-lookup", draft_max=4, max_batch=4)
    drafts = DraftPolicy(spec, _ScriptedDrafter(prompt, expected))
    client = _engine(model, drafts=drafts, speculative=spec)
    try:
        tokens, logprobs, _ = asyncio.run(_generate(client, "spec", prompt))
        assert tokens == expected
        assert drafts.num_accepted >= 4 and drafts.num_drafted - drafts.num_accepted >= 2  # some kept, some not
        plain = _engine(model)
        try:
            assert asyncio.run(_generate(plain, "plain", prompt))[1] == pytest.approx(logprobs, abs=1e-4)
        finally:
            plain.core.stop(10)
    finally:
        client.core.stop(10)


@pytest.mark.parametrize("hybrid", ["qwen3_5_text"], indirect=True)  # the engine paths are the families' same
def test_issue41_aborts_and_preemptions_free_every_state_slot(hybrid, caplog: pytest.LogCaptureFixture) -> None:
    """64 streams on 4 slots and a KV pool too small for all of them (preemptions), a random third of
    them disconnected mid-stream: afterwards no slot is held, and a new request gets the greedy tokens."""
    reference, model = hybrid
    caplog.set_level(logging.INFO, logger="mlxcel.engine.scheduler")
    # 12 blocks of 4 tokens (256 bytes a token: K and V of the one attention layer) beside the state pool; 4
    # streams need up to 28
    client = _engine(model, ctx_size=4 * 32, kv_cache_bytes=_state_pool_bytes(model, ctx_size=4 * 32) + 12 * 4 * 256)
    rng = random.Random(5)

    async def stream(i: int) -> None:
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 20))]
        cut = rng.random() < 0.35
        sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        count = 0
        async for _ in client.generate(Request(f"s{i}", prompt, sampling)):
            count += 1
            if cut and count == 2:
                break  # the client went away: the engine aborts the request

    async def run_all() -> None:
        await asyncio.gather(*(stream(i) for i in range(64)))
        for _ in range(100):  # aborts reach the loop through its inbox
            if not client.core.scheduler.has_work:
                return
            await asyncio.sleep(0.05)

    try:
        asyncio.run(run_all())
        assert client.core.scheduler.num_aborted > 0
        assert any("preempting" in r.getMessage() for r in caplog.records)
        _assert_no_state_held(client)
        assert asyncio.run(_generate(client, "after", PROMPTS[1]))[0] == _transformers_greedy(reference, PROMPTS[1])
    finally:
        client.core.stop(10)


@pytest.mark.parametrize("hybrid", ["qwen3_5_text"], indirect=True)  # the engine paths are the families' same
def test_issue41_a_restarted_engine_resumes_from_snapshots_on_disk(hybrid, tmp_path: Path) -> None:
    """The disk tier keeps the state snapshots beside the KV blocks: after a graceful stop, a new engine
    (a new process's, as far as the cache can tell) resumes the same prompt from disk, with the cold run's
    tokens and logprob bits; a prefix-cache reset deletes the snapshot files too."""
    _, model = hybrid
    disk = dict(prefix_cache_dir=str(tmp_path), prefix_cache_disk_bytes=1 << 26)
    client = _engine(model, **disk)
    try:
        cold = asyncio.run(_generate(client, "cold", PROMPTS[-1]))
    finally:
        client.core.stop(10)
    assert list(tmp_path.rglob("*.rstate")) and list(tmp_path.rglob("*.kvb"))
    client = _engine(model, **disk)
    try:
        warm = asyncio.run(_generate(client, "warm", PROMPTS[-1]))
        assert warm == (cold[0], cold[1], 20) and client.core.states.num_resumed == 1
        assert client.core.reset_prefix_cache().is_reset
        assert not list(tmp_path.rglob("*.rstate"))
    finally:
        client.core.stop(10)


@pytest.mark.parametrize("hybrid", ["qwen3_5_text"], indirect=True)  # the engine paths are the families' same
def test_issue41_slot_save_and_restore_carry_the_state(hybrid, tmp_path: Path) -> None:
    """F12 on a hybrid: the slot file holds the state snapshots along its prefix; after a prefix-cache reset
    and a restore, the same prompt resumes from the restored snapshot with the cold run's tokens and bits."""
    _, model = hybrid
    client = _engine(model, slot_save_path=str(tmp_path), max_num_seqs=1)
    core = client.core
    try:
        cold = asyncio.run(_generate(client, "cold", PROMPTS[-1]))
        assert core.call(lambda: core.save_slot(0, "s.bin")).result(10).num_tokens == 36  # 39 computed: 9 blocks
        core.call(core.reset_prefix_cache).result(10)
        assert asyncio.run(_generate(client, "reset", PROMPTS[-1]))[2] == 0
        core.call(core.reset_prefix_cache).result(10)
        core.call(lambda: core.restore_slot(0, "s.bin")).result(10)
        assert asyncio.run(_generate(client, "restored", PROMPTS[-1])) == (cold[0], cold[1], 20)
    finally:
        core.stop(10)


@pytest.mark.parametrize("hybrid", ["qwen3_5_text"], indirect=True)  # the engine paths are the families' same
def test_issue41_the_state_pool_is_counted_by_kv_cache_memory_and_shown_in_stats(hybrid) -> None:
    """--kv-cache-memory holds the recurrent-state pool beside the blocks (the blocks get what is left); the
    stats (/slots, /metrics, /props) show the pool and each slot's state: its bytes and the snapshots held
    of its running request's prefix."""
    _, model = hybrid
    block_bytes = 4 * 256  # 4 tokens of K and V of the one attention layer (float32)
    pool_bytes = _state_pool_bytes(model)
    assert pool_bytes > block_bytes  # else the pool would not change the block count
    with pytest.raises(ValueError, match="recurrent-state pool"):
        _engine(model, kv_cache_bytes=pool_bytes + 4 * block_bytes)  # one slot's context needs 17 blocks
    client = _engine(model, kv_cache_bytes=pool_bytes + 30 * block_bytes)
    core = client.core
    try:
        assert core.kv.pool.num_blocks == 30
        assert core.memory_budget.state_bytes == core.states.bytes_per_slot > 0
        seen = []

        async def watch() -> None:
            sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            async for _ in client.generate(Request("watched", PROMPTS[-1], sampling)):
                if not seen:
                    seen.append(core.stats())

        asyncio.run(watch())
        running = next(s for s in seen[0].slots if s.request_id == "watched")
        assert running.num_state_bytes == core.states.bytes_per_slot  # no drafts: the live slot alone
        assert running.num_state_snapshots == 1  # the prompt's chunk was split at its last whole block (20)
        pool = core.stats().recurrent_state
        assert pool is not None and pool.num_bytes == pool_bytes and pool.num_snapshots >= 1
        assert pool.num_slots == core.states.tensors.num_slots
        idle = core.stats().slots[0]
        assert idle.num_state_bytes == core.states.bytes_per_slot and idle.num_state_snapshots == 0
    finally:
        core.stop(10)


@pytest.mark.parametrize("hybrid", ["qwen3_5_text"], indirect=True)  # the engine paths are the families' same
def test_issue41_max_kv_size_with_a_hybrid(hybrid) -> None:
    """--max-kv-size windows the attention layers' KV (the recurrent state carries the whole history):
    inside the window the tokens are the unbounded run's; past it the request runs to its end, repeats
    give the same tokens, and every block and state slot is free again."""
    reference, model = hybrid
    client = _engine(model, max_kv_size=64, ctx_size=4 * 128)
    core = client.core
    try:
        inside = asyncio.run(_generate(client, "inside", PROMPTS[-1]))  # 23 + 16 tokens: inside the window
        assert inside[0] == _transformers_greedy(reference, PROMPTS[-1])
        past = asyncio.run(_generate(client, "past", LONG, 24))  # 94 tokens through a 64-token window
        again = asyncio.run(_generate(client, "again", LONG, 24))
        assert len(past[0]) == 24 and again[0] == past[0]
        _assert_no_state_held(client)
        assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks
    finally:
        core.stop(10)


@pytest.mark.parametrize("hybrid", ["qwen3_5_text"], indirect=True)  # the engine paths are the families' same
def test_issue41_snapshots_go_to_disk_with_their_blocks_and_count_in_its_size(hybrid, tmp_path: Path) -> None:
    """A block evicted to the disk tier takes its state snapshot with it (a sidecar file), and a snapshot evicted
    from RAM first goes to disk alone, so an engine that never stopped gracefully (killed: no stop, no save at
    exit) left what a new one resumes from; sidecars count in the disk tier's size."""
    import time

    _, model = hybrid
    small = dict(max_num_seqs=1, ctx_size=64, prefix_cache_dir=str(tmp_path), prefix_cache_disk_bytes=1 << 26)
    # One slot's context (17 blocks) and no more beside the state pool: the next prompt evicts the first's blocks.
    small["kv_cache_bytes"] = _state_pool_bytes(model, **small) + 17 * 4 * 256
    for path in tmp_path.rglob("*"):
        path.unlink() if path.is_file() else None
    killed = _engine(model, **small)
    try:
        cold = asyncio.run(_generate(killed, "cold", PROMPTS[-1]))  # 23 + 16 tokens: 9 blocks cached
        for i, start in enumerate((0, 30)):  # 12 blocks each: the cold prompt's blocks go to disk, then its snapshot
            asyncio.run(_generate(killed, f"evicting{i}", LONG[start:start + 40], 8))
        def on_disk() -> int:
            return sum(p.stat().st_size for p in tmp_path.rglob("*") if p.suffix in (".kvb", ".rstate"))

        disk = killed.core.disk
        deadline = time.monotonic() + 30
        while (disk._queue.qsize() or disk.stats().size_bytes != on_disk()) and time.monotonic() < deadline:
            time.sleep(0.05)  # the writer thread writes blocks with their sidecars, and spilled snapshots alone
        assert list(tmp_path.rglob("*.rstate")) and disk.stats().size_bytes == on_disk()
        # A new engine over the same folder, the first one never stopped: it resumes from the disk snapshot.
        fresh = _engine(model, **small)
        try:
            warm = asyncio.run(_generate(fresh, "warm", PROMPTS[-1]))
            assert warm == (cold[0], cold[1], 20) and fresh.core.states.num_resumed == 1
        finally:
            fresh.core.stop(10)
    finally:
        killed.core.stop(10)
