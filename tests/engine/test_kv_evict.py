"""Evicted KV blocks leave the engine thread cheaply (issue 25 point 2 / issue 29 point 5 follow-up): the pool's
hook only notes them, one batched gather per flush copies them out (into the host tier's rows or the disk
writer's ring), and a writer that falls behind makes saves drop (counted), never the engine wait."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from mlxcel.engine.kv.blocks import BlockPool
from mlxcel.engine.kv.disk import DiskBlockStore, DiskTierConfig, open_disk_tier
from mlxcel.engine.kv.evict import gather_into, payload_bytes
from mlxcel.engine.kv.host import HostBlockTier, open_host_tier
from mlxcel.engine.kv.prefix import KVCacheManager
from mlxcel.engine.kv.tensors import KVCache

from .kv_tiers import block_rows, compute

BLOCK = 4
NUM_BLOCKS = 16


def make_cache(k_type: str = "bf16") -> KVCache:
    return KVCache(3, NUM_BLOCKS, BLOCK, 2, 32, torch.bfloat16, "cpu", k_type=k_type, v_type=k_type)


def prompt(seed: int, num_tokens: int = 3 * BLOCK) -> list[int]:
    return [seed * 1000 + i for i in range(num_tokens)]


def test_gather_into_gives_each_blocks_payload_in_the_disk_layout() -> None:
    """One index_select a cache tensor (all layers, all blocks) equals the per-block, per-layer payload."""
    for k_type in ("bf16", "q8_0"):
        cache = make_cache(k_type)
        for tensor in cache.stacked_tensors().values():
            tensor.view(torch.uint8).copy_(torch.randint(0, 256, tensor.view(torch.uint8).shape, dtype=torch.uint8))
        block_ids = [5, 2, 11]
        out = torch.empty((len(block_ids), payload_bytes(cache)), dtype=torch.uint8)
        gather_into(cache, block_ids, out)
        for index, block in enumerate(block_ids):
            slots = slice(block * BLOCK, (block + 1) * BLOCK)
            expected = b"".join(layer[slots].contiguous().view(torch.uint8).numpy().tobytes()
                                for tensors in cache.named_tensors().values() for layer in tensors)
            assert out[index].numpy().tobytes() == expected


def test_a_burst_of_evictions_in_one_step_is_one_gather_into_the_host_tier() -> None:
    cache = make_cache()
    pool = BlockPool(NUM_BLOCKS, BLOCK)
    kv = KVCacheManager(pool, enable_prefix_caching=True)
    host = open_host_tier(64 * payload_bytes(cache), cache, pool, None)
    assert isinstance(host, HostBlockTier)
    kv.lower_tier = host
    saved = {}
    for seed in range(3):  # 9 cached blocks (and each prompt's partial last one)
        saved[seed] = block_rows(cache, compute(kv, cache, f"r{seed}", prompt(seed, 3 * BLOCK + 1))[:3])
    gathers, evictions = host.pending.num_gathers, pool.num_evictions
    # one scheduling pass: several requests allocate (each evicting cached blocks) before the step writes
    for seed in range(10, 14):
        kv.allocate(f"burst{seed}", prompt(seed), 0, 3 * BLOCK)
    evicted = pool.num_evictions - evictions
    assert evicted >= 6 and len(host.pending.blocks) == evicted
    assert host.stats().num_blocks == 0  # noted only, nothing copied yet
    pool.flush_evictions()
    assert host.pending.num_gathers == gathers + 1  # two prompts' blocks, four allocations: one gather
    assert host.stats().num_blocks == evicted and not host.pending.blocks
    for seed in range(10, 14):
        kv.free(f"burst{seed}")
    blocks, num_cached = kv.find_cached_prefix(prompt(0, 3 * BLOCK + 1), cache_prompt=True)  # evicted in the burst: from host
    assert num_cached == 3 * BLOCK
    assert all(torch.equal(a, b) for a, b in zip(saved[0], block_rows(cache, blocks)))  # bit for bit


def test_a_burst_of_evictions_is_one_gather_into_the_disk_writer(tmp_path: Path) -> None:
    cache = make_cache()
    pool = BlockPool(NUM_BLOCKS, BLOCK)
    kv = KVCacheManager(pool, enable_prefix_caching=True)
    store = open_disk_tier(DiskTierConfig(tmp_path, 1 << 30, "ab" * 32), cache, pool)
    kv.lower_tier = store
    for seed in range(5):
        compute(kv, cache, f"r{seed}", prompt(seed))
    gathers = store.pending.num_gathers
    for seed in range(10, 14):
        kv.allocate(f"burst{seed}", prompt(seed), 0, 3 * BLOCK)
    pool.flush_evictions()
    assert store.pending.num_gathers == gathers + 1
    store.close(pool)  # the writer finishes: every evicted block has its file
    assert store.stats().num_blocks_written >= 11 and store.stats().num_blocks_dropped == 0


def test_a_writer_that_falls_behind_drops_saves_instead_of_blocking(tmp_path: Path) -> None:
    cache = make_cache()
    pool = BlockPool(NUM_BLOCKS, BLOCK)
    kv = KVCacheManager(pool, enable_prefix_caching=True)
    # room in the writer's host ring for 5 blocks: a slow disk fills it at once
    store = open_disk_tier(DiskTierConfig(tmp_path, 5 * payload_bytes(cache), "ab" * 32), cache, pool)
    kv.lower_tier = store
    release = threading.Event()
    write = store._write

    def slow_write(block_hash: int, payload: bytes) -> None:  # a disk that does not answer until released
        release.wait(30)
        write(block_hash, payload)

    store._write = slow_write  # type: ignore[method-assign]
    started = time.perf_counter()
    for seed in range(20):  # 60 blocks cached, each evicted in turn by the next prompts
        compute(kv, cache, f"r{seed}", prompt(seed))
    elapsed = time.perf_counter() - started
    stats = store.stats()
    assert elapsed < 10 and stats.num_blocks_dropped > 0  # never waited for the stalled writer
    assert stats.num_blocks_written == 0
    release.set()
    store.close(pool)
    assert store.stats().num_blocks_written > 0  # what fitted in the ring was written once the disk answered


def test_reset_drops_the_pending_evictions(tmp_path: Path) -> None:
    cache = make_cache()
    pool = BlockPool(NUM_BLOCKS, BLOCK)
    kv = KVCacheManager(pool, enable_prefix_caching=True)
    store: DiskBlockStore = open_disk_tier(DiskTierConfig(tmp_path, 1 << 30, "ab" * 32), cache, pool)
    for seed in range(5):
        compute(kv, cache, f"r{seed}", prompt(seed))
    kv.allocate("burst", prompt(50, NUM_BLOCKS * BLOCK), 0, NUM_BLOCKS * BLOCK)
    assert store.pending.blocks
    store.reset()
    gathers = store.pending.num_gathers
    pool.flush_evictions()  # nothing left to gather: the reset forgot them (they must not land after it)
    assert not store.pending.blocks and store.pending.num_gathers == gathers
    store.close(pool)
