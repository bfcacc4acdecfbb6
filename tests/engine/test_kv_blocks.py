"""BlockPool bookkeeping (spec A3): exact block ids, ref counts and eviction order on CPU."""

from __future__ import annotations

import pytest

from mlxcel.engine.kv.blocks import Block, BlockPool, NoFreeBlocksError


def refs(pool: BlockPool) -> list[int]:
    return [block.ref_count for block in pool.blocks]


def test_a3_fresh_pool_allocates_in_id_order() -> None:
    pool = BlockPool(6, 4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert refs(pool) == [1, 1, 1, 1, 1, 0]
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 5
    assert pool.allocate(0) == []


def test_a3_allocate_short_raises_and_changes_nothing() -> None:
    pool = BlockPool(3, 4)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocksError, match="asked for 2 KV blocks but only 1 are free"):
        pool.allocate(2)
    assert pool.free_block_ids() == [2]
    assert refs(pool) == [1, 1, 0]


def test_a3_free_appends_to_tail_in_given_order() -> None:
    pool = BlockPool(5, 4)
    ids = pool.allocate(3)
    pool.free(ids[::-1])
    assert pool.free_block_ids() == [3, 4, 2, 1, 0]
    # The never-used blocks go first, then the freed ones, last block of the sequence first.
    assert pool.allocate(5) == [3, 4, 2, 1, 0]


def test_a3_double_free_is_an_error() -> None:
    pool = BlockPool(2, 4)
    pool.allocate(1)
    pool.free([0])
    with pytest.raises(ValueError, match="already free"):
        pool.free([0])


def test_a3_shared_block_frees_only_at_zero_refs() -> None:
    pool = BlockPool(3, 4)
    [block_id] = pool.allocate(1)
    pool.touch([block_id])
    assert pool.blocks[0] == Block(0, ref_count=2)
    pool.free([block_id])
    assert pool.num_free_blocks == 2 and pool.blocks[0].ref_count == 1
    pool.free([block_id])
    assert pool.free_block_ids() == [1, 2, 0]


def test_a3_cached_free_block_survives_until_allocated_then_evicted() -> None:
    pool = BlockPool(3, 4)
    ids = pool.allocate(2)
    assert pool.cache_block(ids[0], 111) and pool.cache_block(ids[1], 222)
    pool.free(ids[::-1])
    assert pool.num_cached_blocks == 2 and pool.lookup(111) == 0 and pool.lookup(222) == 1
    assert pool.allocate(1) == [2]  # an uncached free block is taken first
    assert pool.num_evictions == 0 and pool.lookup(222) == 1
    assert pool.allocate(1) == [1]  # now the LRU cached block: evicted
    assert pool.num_evictions == 1 and pool.lookup(222) is None and pool.blocks[1].block_hash is None
    assert pool.num_cached_blocks == 1 and pool.lookup(111) == 0


def test_a3_touch_takes_a_cached_block_out_of_the_free_queue() -> None:
    pool = BlockPool(4, 4)
    ids = pool.allocate(2)
    pool.cache_block(ids[1], 7)
    pool.free(ids[::-1])
    assert pool.free_block_ids() == [2, 3, 1, 0]
    pool.touch([pool.lookup(7)])
    assert pool.free_block_ids() == [2, 3, 0]
    assert pool.blocks[1].ref_count == 1 and pool.num_cached_blocks == 0
    assert pool.allocate(3) == [2, 3, 0]
    assert pool.lookup(7) == 1 and pool.num_evictions == 0


def test_a3_cache_block_first_writer_wins() -> None:
    pool = BlockPool(3, 4)
    first, second = pool.allocate(2)
    assert pool.cache_block(first, 5) is True
    assert pool.cache_block(second, 5) is False
    assert pool.lookup(5) == first and pool.blocks[second].block_hash is None
    assert pool.cache_block(first, 5) is False  # the same registration again is a no-op
    with pytest.raises(ValueError, match="different prefix hash"):
        pool.cache_block(first, 6)
    with pytest.raises(ValueError, match="is free"):
        pool.cache_block(2, 9)


def test_a3_uncache_block_drops_a_hash_in_use_or_free() -> None:
    pool = BlockPool(2, 4)
    a, b = pool.allocate(2)
    pool.cache_block(a, 1)
    pool.cache_block(b, 2)
    pool.free([b])
    assert pool.uncache_block(a) and pool.uncache_block(b)
    assert not pool.uncache_block(b)
    assert pool.num_hashed_blocks == 0 and pool.num_cached_blocks == 0


def test_a3_reset_prefix_cache_refuses_while_a_block_is_in_use() -> None:
    pool = BlockPool(3, 4)
    a, b = pool.allocate(2)
    pool.cache_block(a, 1)
    pool.cache_block(b, 2)
    pool.free([b])
    assert pool.reset_prefix_cache() is False
    assert pool.lookup(1) == a and pool.lookup(2) == b
    pool.free([a])
    assert pool.reset_prefix_cache() is True
    assert pool.num_hashed_blocks == 0 and pool.num_cached_blocks == 0
    assert all(block.block_hash is None for block in pool.blocks)


def test_a3_clear_free_cached_blocks_keeps_blocks_in_use() -> None:
    pool = BlockPool(3, 4)
    a, b = pool.allocate(2)
    pool.cache_block(a, 1)
    pool.cache_block(b, 2)
    pool.free([b])
    assert pool.clear_free_cached_blocks() == 1
    assert pool.lookup(1) == a and pool.lookup(2) is None
    assert pool.num_cached_blocks == 0 and pool.num_evictions == 0
    pool.free([a])
    assert pool.num_cached_blocks == 1  # a's hash survived the clear and is free now


def test_a3_caching_disabled_pool_never_indexes() -> None:
    pool = BlockPool(2, 4, enable_caching=False)
    [a] = pool.allocate(1)
    assert pool.cache_block(a, 3) is False
    assert pool.lookup(3) is None and pool.blocks[a].block_hash is None


def test_a3_pool_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="at least 1 block"):
        BlockPool(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, 0)
    with pytest.raises(ValueError, match="negative"):
        BlockPool(4, 4).allocate(-1)
