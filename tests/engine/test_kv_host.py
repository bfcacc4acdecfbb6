"""The prefix cache's host-memory tier (issue 29 point 5) on tiny CPU KV tensors: forced on with the CPU device,
it keeps exact bytes, respects its LRU bound, spills to the disk tier and forgets on reset."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from mlxcel.engine.kv.blocks import BlockPool
from mlxcel.engine.kv.disk import DiskBlockStore, DiskTierConfig, open_disk_tier
from mlxcel.engine.kv.disk import block_layout
from mlxcel.engine.kv.host import HostBlockTier, default_host_bytes, open_host_tier
from mlxcel.engine.kv.prefix import KVCacheManager
from mlxcel.engine.kv.tensors import KVCache

from .kv_tiers import block_rows, compute

BLOCK = 4
NUM_BLOCKS = 8
ROW_BYTES = 2 * 2 * BLOCK * 2 * 32 * 2  # k and v, 2 layers, a block's tokens x 2 heads x 32 dims in bf16


class Engine:
    """A pool, a manager and a CPU cache with a host tier of `host_blocks` blocks (and a disk tier under it)."""

    def __init__(self, folder: Path | None, host_blocks: int, *, k_type: str = "bf16") -> None:
        self.cache = KVCache(2, NUM_BLOCKS, BLOCK, 2, 32, torch.bfloat16, "cpu", k_type=k_type, v_type=k_type)
        self.pool = BlockPool(NUM_BLOCKS, BLOCK)
        self.kv = KVCacheManager(self.pool, enable_prefix_caching=True)
        self.disk: DiskBlockStore | None = None
        if folder is not None:
            self.disk = open_disk_tier(DiskTierConfig(folder, 1 << 30, "ab" * 32), self.cache, self.pool)
        row_bytes = sum(size for _, size in block_layout(self.cache)) * 2
        host = open_host_tier(host_blocks * row_bytes, self.cache, self.pool, self.disk)
        assert host is not None
        self.host: HostBlockTier = host
        self.kv.lower_tier = host

    def compute(self, request_id: str, tokens: list[int]) -> list[int]:
        return compute(self.kv, self.cache, request_id, tokens)

    def rows(self, block_ids: list[int]) -> list[torch.Tensor]:
        return block_rows(self.cache, block_ids)

    def evict_all(self, seed: int = 99) -> None:
        """A prompt that takes every block: everything cached leaves the pool."""
        self.compute(f"evict{seed}", prompt(seed, NUM_BLOCKS * BLOCK))


def prompt(seed: int, num_tokens: int = 3 * BLOCK + 1) -> list[int]:
    return [seed * 1000 + i for i in range(num_tokens)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_row_bytes_match_the_disk_payload() -> None:
    engine = Engine(None, 4)
    assert engine.host.row_bytes == ROW_BYTES and engine.host.is_pinned == torch.cuda.is_available()


def test_device_eviction_then_host_hit_restores_the_exact_blocks() -> None:
    engine = Engine(None, 16)
    tokens = prompt(1)
    saved = engine.rows(engine.compute("a", tokens)[:3])
    engine.evict_all()  # "a"'s three blocks (and nothing else cached) go to host memory
    assert engine.host.stats().num_blocks == 3
    blocks, num_cached = engine.kv.find_cached_prefix(tokens, cache_prompt=True)
    assert num_cached == 3 * BLOCK and same(saved, engine.rows(blocks))  # restored == computed, bit for bit
    stats = engine.host.stats()
    assert (stats.num_hits, stats.num_blocks_loaded, stats.num_bytes_loaded) == (1, 3, 3 * ROW_BYTES)
    assert stats.num_blocks_stored >= 3 and stats.load_seconds > 0
    # exclusive: the loaded blocks left host memory (the 3 there now are the ones their allocation evicted)
    assert not set(engine.host._entries) & {engine.pool.blocks[b].block_hash for b in blocks}


def hashes(engine: Engine, block_ids: list[int]) -> list[int]:
    return [engine.pool.blocks[b].block_hash for b in block_ids]


def test_lru_bound_keeps_a_spare_row_by_spilling_the_oldest_to_disk(tmp_path: Path) -> None:
    engine = Engine(tmp_path, 4)  # with a disk tier one row (an eighth of the bound, at least one) is kept spare
    first = prompt(1)
    table = engine.compute("a", first)[:3]
    saved, first_hashes = engine.rows(table), hashes(engine, table)
    engine.evict_all(98)  # a's 3 blocks to host memory; the fourth row is the spare one
    assert engine.host.stats().num_blocks == 3 and engine.host.stats().num_blocks_spilled == 0
    engine.evict_all(97)  # 98's 8 blocks: the newest takes the spare row, the 7 older go straight to disk, and
    # the least recently used entry (a's first evicted block) goes to the writer: a row is on its way back
    stats = engine.host.stats()
    assert stats.num_blocks == 3 and stats.size_bytes == 3 * ROW_BYTES <= stats.capacity_bytes
    assert stats.num_blocks_spilled == 8 and len(set(first_hashes) & set(engine.host._entries)) == 2
    engine.host.close()  # the graceful stop: what host memory holds goes to disk too
    assert engine.disk is not None
    engine.disk.close(engine.pool, timeout=30)  # drain the writer (it also saves the pool's blocks)
    fresh = Engine(tmp_path, 4)  # a restart: a's blocks come back from disk, through the host tier
    blocks, num_cached = fresh.kv.find_cached_prefix(first, cache_prompt=True)
    assert num_cached == 3 * BLOCK and same(saved, fresh.rows(blocks))
    assert fresh.host.stats().num_misses == 1 and fresh.disk is not None and fresh.disk.stats().num_hits == 1


def test_a_row_on_its_way_to_disk_is_not_reused_before_it_is_written(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """The writer reads a spilled entry's row itself (no copy on the engine thread): until it has, later
    evictions must not land in that row."""
    engine = Engine(tmp_path, 4)
    assert engine.disk is not None
    gate, write = threading.Event(), engine.disk._write
    monkeypatch.setattr(engine.disk, "_write", lambda block_hash, payload: (gate.wait(30), write(block_hash, payload)))
    first = prompt(1)
    saved = engine.rows(engine.compute("a", first)[:3])
    engine.evict_all(98)
    engine.evict_all(97)  # as above: one of a's blocks queued for the writer, which is stuck on 98's
    held = dict(engine.host._entries)
    engine.evict_all(96)  # 97's 8 blocks: no row is spare (one is the writer's), so all go straight to disk
    assert engine.host._entries == held and engine.host.stats().num_blocks_spilled == 16
    gate.set()
    engine.host.close()
    engine.disk.close(engine.pool, timeout=30)
    fresh = Engine(tmp_path, 4)
    blocks, num_cached = fresh.kv.find_cached_prefix(first, cache_prompt=True)
    assert num_cached == 3 * BLOCK and same(saved, fresh.rows(blocks))  # the spilled row kept a's bytes


def test_a_run_from_host_then_from_disk(tmp_path: Path) -> None:
    """The head of a prompt in host memory, its tail only on disk: both tiers serve their part."""
    engine = Engine(tmp_path, 4)
    tokens = prompt(1, 6 * BLOCK + 1)
    saved = engine.rows(engine.compute("a", tokens)[:6])
    engine.evict_all()  # 6 blocks leave at once (the tail first): 2 go straight to disk, 4 to host memory,
    # of which the least recently used then goes to the writer to keep a row spare
    assert engine.disk is not None
    assert engine.host.stats().num_blocks == 3 and engine.host.stats().num_blocks_spilled == 3
    wait_for_files(engine.disk, 3)
    blocks, num_cached = engine.kv.find_cached_prefix(tokens, cache_prompt=True)
    assert num_cached == 6 * BLOCK and same(saved, engine.rows(blocks))
    assert engine.host.stats().num_hits == 1 and engine.disk.stats().num_blocks_read == 3


def wait_for_files(disk: DiskBlockStore, count: int) -> None:
    import time
    deadline = time.monotonic() + 30
    while len(list(disk.folder.glob("*.kvb"))) < count and time.monotonic() < deadline:
        time.sleep(0.01)


def test_reset_forgets_the_host_blocks() -> None:
    engine = Engine(None, 16)
    tokens = prompt(1)
    engine.compute("a", tokens)
    engine.evict_all()
    assert engine.host.reset() == 3 and engine.host.stats().num_blocks == 0
    engine.pool.clear_free_cached_blocks()
    assert engine.kv.find_cached_prefix(tokens, cache_prompt=True) == ([], 0)
    engine.compute("b", prompt(2))  # the freed rows are reused
    engine.evict_all(98)
    assert engine.host.stats().num_blocks == 3


def test_quantized_kv_round_trips() -> None:
    engine = Engine(None, 16, k_type="q8_0")
    tokens = prompt(1)
    saved = engine.rows(engine.compute("a", tokens)[:3])
    engine.evict_all()
    blocks, _ = engine.kv.find_cached_prefix(tokens, cache_prompt=True)
    assert same(saved, engine.rows(blocks))


def test_auto_size_is_a_share_of_ram_on_cuda_only() -> None:
    assert default_host_bytes("cpu") == 0
    assert default_host_bytes("cuda:0") > 1 << 30


def test_copies_go_by_runs_of_consecutive_rows_within_a_slab() -> None:
    engine = Engine(None, 16)
    engine.host._slab_rows = 4
    assert engine.host._runs([0, 1, 2, 3, 4, 5, 9, 8, 10]) == [(0, 0, 4), (4, 4, 2), (6, 9, 1), (7, 8, 1), (8, 10, 1)]


def test_rows_across_several_slabs_round_trip(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr("mlxcel.engine.kv.host._SLAB_BYTES", 2 * ROW_BYTES)  # 2 rows a slab
    engine = Engine(None, 5)
    tokens = prompt(1, 5 * BLOCK + 1)
    saved = engine.rows(engine.compute("a", tokens)[:5])
    engine.evict_all()
    assert len(engine.host._slabs) == 3 and engine.host._slabs[-1].shape[0] == 1  # 2 + 2 + 1 rows: the bound
    blocks, num_cached = engine.kv.find_cached_prefix(tokens, cache_prompt=True)
    assert num_cached == 5 * BLOCK and same(saved, engine.rows(blocks))
