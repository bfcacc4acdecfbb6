"""Issue 25 point 2 / issue 29 point 5 follow-up: the engine thread's cost of saving KV blocks evicted from the pool.

    PYTHONPATH=src python3 bench/evict_cost.py [--tier disk|host] [--device cpu|cuda] [--rounds 20]

A SmolLM2-135M-shaped KV cache (30 layers, 3 KV heads x 64, block 16, bfloat16) with the disk tier (or the
host tier over it) wired under its pool; each round, 64 requests of 4 blocks each allocate (evicting 256
cached blocks, as 64 fresh streams do) and the pool is flushed as the engine does before a step. Reported:
the engine-thread seconds per evicted block spent in the allocations and the flush (the eviction hook's
work), the writer's files, and the blocks dropped. Run it with another tree's sources (PYTHONPATH=OTHER/src)
for a before/after figure: a tree without `flush_evictions` saves inside the allocation.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from mlxcel.engine.kv.blocks import BlockPool
from mlxcel.engine.kv.disk import DiskTierConfig, open_disk_tier
from mlxcel.engine.kv.host import open_host_tier
from mlxcel.engine.kv.tensors import KVCache

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
STREAMS, BLOCKS_EACH = 64, 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", choices=("disk", "host"), default="disk")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    num_blocks = 2 * STREAMS * BLOCKS_EACH
    cache = KVCache(LAYERS, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16, args.device)
    for layer in cache.k + cache.v:
        layer.normal_()
    pool = BlockPool(num_blocks, BLOCK)
    with tempfile.TemporaryDirectory() as folder:
        disk = open_disk_tier(DiskTierConfig(Path(folder), 64 << 30, "ab" * 32), cache, pool)
        host = open_host_tier(1 << 30, cache, pool, disk) if args.tier == "host" else None
        flush = getattr(pool, "flush_evictions", lambda: None)
        engine_s, evicted, next_hash = 0.0, 0, 1
        for round_ in range(args.rounds + 1):  # round 0 only fills the pool with cached blocks
            started, before = time.perf_counter(), pool.num_evictions
            tables = [pool.allocate(BLOCKS_EACH) for _ in range(STREAMS)]
            flush()
            if args.device == "cuda":
                torch.cuda.current_stream().synchronize()  # (not the side streams: those are off the engine)
            if round_ > 0:
                engine_s += time.perf_counter() - started
                evicted += pool.num_evictions - before
            for table in tables:  # the streams finish: their blocks stay cached, evictable by the next round
                for block_id in table:
                    pool.cache_block(block_id, next_hash)
                    next_hash += 1
                pool.free(table[::-1])
        if host is not None:
            host.close()
        disk.close(pool)
        stats = disk.stats()
        print(json.dumps({"tier": args.tier, "device": args.device, "evicted_blocks": evicted,
                          "engine_us_per_block": round(engine_s / max(evicted, 1) * 1e6, 1),
                          "engine_ms_per_round": round(engine_s / args.rounds * 1e3, 2),
                          "files_written": stats.num_blocks_written,
                          "dropped": getattr(stats, "num_blocks_dropped", None),
                          "write_errors": stats.num_write_errors}))


if __name__ == "__main__":
    main()
