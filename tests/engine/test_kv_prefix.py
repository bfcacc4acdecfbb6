"""KVCacheManager and chain hashing (spec A3, M, N): exact block ids, ref counts, eviction
order and counters on tiny pools (block_size 4), in the manner of vLLM's prefix-caching tests."""

from __future__ import annotations

import pytest

from mlxcel.engine.kv.blocks import BlockPool
from mlxcel.engine.kv.prefix import (
    RELEASED_BLOCK,
    KVCacheManager,
    hash_block_tokens,
    hash_prompt_blocks,
)
from mlxcel.types import PrefixCacheStats

BLOCK = 4


def tokens(num: int, start: int = 100) -> list[int]:
    return list(range(start, start + num))


def manager(num_blocks: int = 8, *, enabled: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, BLOCK), enable_prefix_caching=enabled)


def refs(kv: KVCacheManager) -> list[int]:
    return [block.ref_count for block in kv.pool.blocks]


def admit(kv: KVCacheManager, rid: str, prompt: list[int], *, cache_prompt: bool = True) -> list[int] | None:
    """What the scheduler does at admission: look up, then allocate the whole prompt."""
    cached, num_cached = kv.find_cached_prefix(prompt, cache_prompt=cache_prompt)
    return kv.allocate(rid, prompt, num_cached, len(prompt) - num_cached, cached, cache_prompt=cache_prompt)


def assert_all_free(kv: KVCacheManager) -> None:
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert refs(kv) == [0] * kv.pool.num_blocks


# ---- hashing ----


def test_a3_chain_hash_depends_on_parent_tokens_and_extra() -> None:
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hash_block_tokens(None, (1, 2, 3, 4))
    assert hash_block_tokens(first, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4], extra="lora-a") != first
    assert hash_block_tokens(None, [1, 2, 3]) != hash_block_tokens(None, [1, 2, 3, 0])


def test_a3_prompt_hashes_cover_full_blocks_only() -> None:
    prompt = tokens(11)
    hashes = hash_prompt_blocks(prompt, BLOCK)
    assert len(hashes) == 2
    assert hashes[1] == hash_block_tokens(hash_block_tokens(None, prompt[:4]), prompt[4:8])
    assert hash_prompt_blocks(prompt[:3], BLOCK) == []


# ---- allocation and sharing ----


def test_a3_fresh_request_gets_blocks_in_order_and_donates_full_ones() -> None:
    kv = manager()
    prompt = tokens(10)
    assert admit(kv, "a", prompt) == [0, 1, 2]
    assert kv.block_table("a") == [0, 1, 2]
    hashes = hash_prompt_blocks(prompt, BLOCK)
    assert [kv.pool.lookup(h) for h in hashes] == [0, 1]
    assert kv.pool.blocks[2].block_hash is None  # the partial last block is never cached
    assert kv.num_cached_tokens("a") == 0


def test_a3_two_requests_share_a_two_block_prefix() -> None:
    kv = manager()
    shared = tokens(8)
    admit(kv, "a", shared + [1, 2])
    assert kv.find_cached_prefix(shared + [3, 4, 5], cache_prompt=True) == ([0, 1], 8)
    assert admit(kv, "b", shared + [3, 4, 5]) == [3]
    assert kv.block_table("b") == [0, 1, 3]
    assert refs(kv)[:4] == [2, 2, 1, 1]
    assert kv.num_cached_tokens("b") == 8
    kv.free("a")
    assert refs(kv)[:4] == [1, 1, 0, 1]
    assert kv.pool.free_block_ids()[-1] == 2  # only a's own block went back
    kv.free("b")
    assert_all_free(kv)


def test_a3_full_hit_leaves_the_last_token_to_compute() -> None:
    kv = manager()
    prompt = tokens(8)
    admit(kv, "a", prompt)
    kv.free("a")
    # Every block of an 8-token prompt is cached; the last block is dropped so token 7
    # is recomputed and produces logits.
    assert kv.find_cached_prefix(prompt, cache_prompt=True) == ([0], 4)
    assert kv.find_cached_prefix(prompt + [9], cache_prompt=True) == ([0, 1], 8)
    assert kv.find_cached_prefix(prompt[:1], cache_prompt=True) == ([], 0)
    assert kv.find_cached_prefix([], cache_prompt=True) == ([], 0)
    assert admit(kv, "b", prompt) == [2]
    assert kv.block_table("b") == [0, 2]
    assert kv.num_cached_tokens("b") == 4


def test_a3_full_hit_with_the_last_block_leaves_only_the_last_token() -> None:
    """Issue 11: the scheduler's lookup may hit the block holding the last token too (its KV is
    cached; only its logits are computed), so a repeated prompt recomputes 1 token, not a block."""
    kv = manager()
    prompt = tokens(8)
    admit(kv, "a", prompt)
    kv.free("a")
    assert kv.find_cached_prefix(prompt, cache_prompt=True, include_last_block=True) == ([0, 1], 7)
    assert kv.find_cached_prefix(prompt + [9], cache_prompt=True, include_last_block=True) == ([0, 1], 8)
    assert kv.find_cached_prefix(prompt[:7], cache_prompt=True, include_last_block=True) == ([0], 4)
    assert kv.find_cached_prefix([], cache_prompt=True, include_last_block=True) == ([], 0)
    cached, num_cached = kv.find_cached_prefix(prompt, cache_prompt=True, include_last_block=True)
    assert kv.allocate("b", prompt, num_cached, 1, cached) == []  # no new block: both are shared hits
    assert kv.block_table("b") == [0, 1] and refs(kv)[:2] == [1, 1]
    assert kv.num_cached_tokens("b") == 8
    assert kv.allocate("b", prompt + [5], 8, 1) == [2]  # the first output token gets a block of its own
    kv.free("b", num_computed_tokens=8)
    assert kv.find_cached_prefix(prompt, cache_prompt=True, include_last_block=True) == ([0, 1], 7)


def test_a3_freed_blocks_are_evicted_lru_last_blocks_first() -> None:
    kv = manager(6)
    prompt_a = tokens(12)
    admit(kv, "a", prompt_a)
    kv.free("a")
    assert kv.pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    assert kv.pool.num_cached_blocks == 3
    assert admit(kv, "b", tokens(8, start=500)) == [3, 4]  # uncached blocks first
    assert kv.pool.num_evictions == 0
    assert admit(kv, "c", tokens(8, start=900)) == [5, 2]  # then a's LAST block
    assert kv.pool.num_evictions == 1
    assert kv.find_cached_prefix(prompt_a + [1], cache_prompt=True) == ([0, 1], 8)
    assert admit(kv, "d", tokens(4, start=700)) == [1]
    assert kv.pool.num_evictions == 2
    assert kv.find_cached_prefix(prompt_a + [1], cache_prompt=True) == ([0], 4)
    for rid in "bcd":
        kv.free(rid)
    assert_all_free(kv)


def test_a3_chunked_prefill_and_decode_donate_as_blocks_fill() -> None:
    kv = manager()
    seq = tokens(10)
    assert kv.allocate("a", seq, 0, 6) == [0, 1]  # first chunk: 6 of 10 prompt tokens
    assert kv.pool.blocks[0].block_hash is not None and kv.pool.blocks[1].block_hash is None
    assert kv.allocate("a", seq, 6, 4) == [2]
    assert kv.pool.blocks[1].block_hash is not None and kv.pool.blocks[2].block_hash is None
    seq += [1, 2]  # two sampled tokens: the last is fed in the next step
    assert kv.allocate("a", seq, 11, 1) == []
    assert kv.pool.lookup(hash_prompt_blocks(seq, BLOCK)[2]) == 2


def test_a3_draft_positions_get_room_but_are_not_hashed() -> None:
    kv = manager()
    seq = tokens(6)
    kv.allocate("a", seq, 0, 6)
    assert kv.allocate("a", seq, 6, 3) == [2]  # room for 3 draft tokens past the known 6
    assert kv.pool.blocks[1].block_hash is None


def test_a3_same_prompt_admitted_together_first_writer_wins() -> None:
    kv = manager()
    prompt = tokens(9)
    cached_b, _ = kv.find_cached_prefix(prompt, cache_prompt=True)  # before a donates
    admit(kv, "a", prompt)
    assert kv.allocate("b", prompt, 0, 9, cached_b) == [3, 4, 5]
    assert [kv.pool.blocks[i].block_hash is None for i in (3, 4)] == [True, True]
    kv.free("a")
    kv.free("b")
    assert kv.find_cached_prefix(prompt, cache_prompt=True) == ([0, 1], 8)


def test_a3_extra_keeps_prefixes_apart() -> None:
    kv = manager()
    prompt = tokens(9)
    cached, num = kv.find_cached_prefix(prompt, cache_prompt=True, extra="lora-1")
    kv.allocate("a", prompt, num, 9 - num, cached, extra="lora-1")
    assert kv.find_cached_prefix(prompt, cache_prompt=True) == ([], 0)
    assert kv.find_cached_prefix(prompt, cache_prompt=True, extra="lora-1") == ([0, 1], 8)


# ---- cache_prompt=false, disabled caching ----


def test_m_cache_prompt_false_reads_nothing_and_donates_nothing() -> None:
    kv = manager()
    prompt = tokens(9)
    admit(kv, "a", prompt)
    kv.free("a")
    assert kv.find_cached_prefix(prompt, cache_prompt=False) == ([], 0)
    before = kv.stats()
    assert admit(kv, "b", prompt + tokens(8, start=300), cache_prompt=False) == [3, 4, 5, 6, 7]
    assert all(kv.pool.blocks[i].block_hash is None for i in (3, 4, 5, 6, 7))
    assert kv.pool.num_hashed_blocks == 2
    # Not counted as a hit or a miss: the cache was not consulted.
    after = kv.stats()
    assert (after.num_hits, after.num_misses, after.num_reused_tokens) == (
        before.num_hits, before.num_misses, before.num_reused_tokens,
    ) == (0, 1, 0)
    assert kv.num_cached_tokens("b") == 0
    with pytest.raises(ValueError, match="caching is off"):
        kv.allocate("c", prompt, 4, 5, [0], cache_prompt=False)


def test_a3_disabled_prefix_caching_reads_and_donates_nothing() -> None:
    kv = manager(enabled=False)
    prompt = tokens(9)
    assert admit(kv, "a", prompt) == [0, 1, 2]
    kv.free("a")
    assert kv.find_cached_prefix(prompt, cache_prompt=True) == ([], 0)
    assert kv.pool.num_hashed_blocks == 0
    assert kv.stats() == PrefixCacheStats(is_enabled=False, num_blocks_free=8)
    assert kv.reset() is False
    pool_off = KVCacheManager(BlockPool(4, BLOCK, enable_caching=False), enable_prefix_caching=True)
    assert pool_off.is_enabled is False


# ---- failure leaves everything unchanged ----


def test_a3_allocate_none_leaves_the_pool_unchanged() -> None:
    kv = manager(4)
    prompt = tokens(12)
    admit(kv, "a", prompt)
    kv.free("a")
    queue, ref_counts, stats = kv.pool.free_block_ids(), refs(kv), kv.stats()
    # 2 hits sitting in the free queue + 3 new blocks > 4 free blocks.
    assert admit(kv, "b", prompt[:8] + tokens(9, start=400)) is None
    assert kv.pool.free_block_ids() == queue and refs(kv) == ref_counts and kv.stats() == stats
    with pytest.raises(KeyError, match="'b'"):
        kv.block_table("b")
    assert admit(kv, "b", prompt[:8] + tokens(5, start=400)) == [3, 2]
    assert kv.block_table("b") == [0, 1, 3, 2]
    assert kv.allocate("b", prompt[:8] + tokens(5, start=400), 13, 4) is None  # running request
    assert kv.block_table("b") == [0, 1, 3, 2] and kv.pool.num_free_blocks == 0
    assert kv.can_allocate(0) and not kv.can_allocate(1)


def test_a3_stale_cached_blocks_are_refused() -> None:
    kv = manager(4)
    prompt = tokens(9)
    admit(kv, "a", prompt)
    kv.free("a")
    cached, num = kv.find_cached_prefix(prompt, cache_prompt=True)
    admit(kv, "x", tokens(16, start=800))  # evicts the hits in between
    kv.free("x")
    with pytest.raises(ValueError, match="no longer holds this prefix"):
        kv.allocate("b", prompt, num, 9 - num, cached)
    admit(kv, "c", tokens(4))
    with pytest.raises(ValueError, match="first allocate"):
        kv.allocate("c", tokens(4), 4, 1, [0])


# ---- reset, free_prefix, free after a failed step ----


def test_f7_reset_drops_free_cached_blocks_even_under_load() -> None:
    kv = manager()
    admit(kv, "a", tokens(9))
    admit(kv, "b", tokens(9, start=300))
    kv.free("a")
    assert kv.pool.num_cached_blocks == 2
    assert kv.reset() is True
    assert kv.pool.num_cached_blocks == 0
    assert kv.find_cached_prefix(tokens(9), cache_prompt=True) == ([], 0)
    assert kv.find_cached_prefix(tokens(9, start=300), cache_prompt=True) == ([3, 4], 8)
    assert kv.stats().num_evictions == 0


def test_n_free_prefix_releases_whole_blocks_and_keeps_positions() -> None:
    kv = manager()
    seq = tokens(14)
    kv.allocate("a", seq, 0, 14)
    assert kv.block_table("a") == [0, 1, 2, 3]
    assert kv.free_prefix("a", 11) == 2  # blocks 0 and 1 lie wholly before token 11
    assert kv.block_table("a") == [RELEASED_BLOCK, RELEASED_BLOCK, 2, 3]
    assert kv.pool.free_block_ids()[-2:] == [1, 0]
    assert kv.free_prefix("a", 11) == 0  # idempotent
    assert kv.slot_mapping("a", 12, 15) == [12, 13, 14]  # block 3 * 4 + offsets 0..2
    with pytest.raises(ValueError, match="released"):
        kv.slot_mapping("a", 7, 9)
    seq += [1, 2]
    assert kv.allocate("a", seq, 15, 1) == []
    assert kv.pool.blocks[3].block_hash is None  # windowed tokens are never donated
    assert kv.find_cached_prefix(tokens(9), cache_prompt=True) == ([0, 1], 8)  # pre-window KV
    assert kv.allocate("a", seq + [3], 16, 1) == [4]
    assert kv.block_table("a") == [-1, -1, 2, 3, 4]
    kv.free("a")
    assert_all_free(kv)


def test_a3_free_after_an_uncomputed_allocation_uncaches_its_donations() -> None:
    kv = manager()
    prompt = tokens(13)
    kv.allocate("a", prompt, 0, 5)
    kv.allocate("a", prompt, 5, 8)  # donated blocks 1 and 2 for a step that never ran
    kv.free("a", num_computed_tokens=5)
    assert kv.find_cached_prefix(prompt, cache_prompt=True) == ([0], 4)
    assert kv.pool.num_cached_blocks == 1
    kv.free("a")  # freeing an unknown request is a no-op (aborts may race)
    assert_all_free(kv)


# ---- counters and the full cycle ----


def test_a3_stats_count_hits_misses_reuse_and_blocks() -> None:
    kv = manager(6)
    admit(kv, "a", tokens(9))
    admit(kv, "b", tokens(9))
    admit(kv, "c", tokens(4, start=50))
    assert kv.stats() == PrefixCacheStats(
        is_enabled=True,
        num_hits=1,
        num_misses=2,
        num_reused_tokens=8,
        num_blocks_used=5,
        num_blocks_free=1,
        num_blocks_cached=0,
        num_evictions=0,
    )
    kv.free("a")
    kv.free("b")
    stats = kv.stats()
    assert (stats.num_blocks_used, stats.num_blocks_free, stats.num_blocks_cached) == (1, 5, 2)
    admit(kv, "d", tokens(20, start=60))
    assert kv.stats().num_evictions == 2 and kv.stats().num_blocks_cached == 0


def test_a3_pool_returns_to_all_free_after_a_mixed_load() -> None:
    kv = manager(16)
    base = tokens(8)
    prompts = {f"r{i}": base + tokens(i + 1, start=1000 * (i + 1)) for i in range(6)}
    for rid, prompt in prompts.items():
        assert admit(kv, rid, prompt, cache_prompt=rid != "r3") is not None
    for rid, prompt in prompts.items():
        prompt.append(7)
        kv.allocate(rid, prompt, len(prompt) - 1, 1)
    kv.free_prefix("r1", 8)
    assert refs(kv)[:2] == [4, 4]  # r0, r2, r4, r5 share the base; r1 released it, r3 opted out
    for rid in reversed(prompts):
        kv.free(rid)
    assert_all_free(kv)
    assert kv.stats().num_blocks_used == 0
