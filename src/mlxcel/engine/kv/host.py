"""The prefix cache's host-memory tier (issue 29 point 5): KV blocks evicted from GPU memory parked in pinned
host RAM under an LRU bound, between the device pool and the disk tier.

A block here is its disk-file payload (disk.py's byte layout), one row of a pinned slab. The pool's eviction
hook only notes the evicted blocks; the pool's flush (before any KV write) gathers them in one batch on the
compute stream (so before the kernels that overwrite them, evict.py) and a side stream copies them to host
memory, an event marking the rows ready: the engine thread never waits for a copy. On CUDA the pinned slabs
are allocated by a grower thread ahead of need, never by the engine thread; a block with no row ready goes
straight to the disk tier's writer (or is dropped, counted, without one).
A device miss asks `load`: the longest run held here is copied back with non-blocking copies on the compute
stream (which first waits on the rows' events) and scattered into freshly allocated blocks, all queued before
the step that reads them; the rest of the prompt is asked of the disk tier. With a disk tier, the least recently
used rows are handed to its writer ahead of need, keeping a reserve of spare rows: the writer reads the rows
themselves (no copy on the engine thread) and gives each back once written. On the CPU (the flag forces the
tier on, for tests) the same code copies synchronously.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, replace

import torch

from mlxcel.engine.kv.blocks import BlockPool
from mlxcel.engine.kv.disk import DiskBlockStore, block_layout, payload_len, scatter_payloads
from mlxcel.engine.kv.evict import PendingEvictions, chunks
from mlxcel.engine.kv.tensors import KVCache
from mlxcel.types import HostCacheStats

log = logging.getLogger(__name__)

_SLAB_BYTES = 64 << 20  # pinned rows are allocated in slabs as the tier fills (by the grower thread on CUDA):
# pinning a share of RAM up front would cost seconds at startup
_SPILL_BATCH = 64  # blocks per disk-writer batch (spills ahead, and at the graceful stop)
_RESERVE_SHARE = 8  # with a disk tier, spare rows kept: an eighth of the capacity, at most _RESERVE_CHUNKS gathers'
_RESERVE_CHUNKS = 4


def default_host_bytes(device: torch.device | str) -> int:
    """`--prefix-cache-host-size auto`: a quarter of physical RAM on CUDA; 0 elsewhere (on the CPU the KV pool
    already is host memory)."""
    if torch.device(device).type != "cuda":
        return 0
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError):
        return 0


def available_room(pool: BlockPool, hit_blocks: list[int], num_rest_tokens: int, num_run: int) -> int:
    """How many blocks a lower tier may load: the free ones, less the hits the request takes out of the free
    queue and a reserve for the rest of its prompt (at most one prefill chunk) and its first output."""
    size = pool.block_size
    reserve = -(-min(num_rest_tokens - num_run * size, 2048) // size) + 1
    return pool.num_free_blocks - sum(pool.blocks[b].ref_count == 0 for b in hit_blocks) - reserve


@dataclass(slots=True)
class _Entry:
    row: int
    ready: torch.cuda.Event | None  # the device->host copy into the row has run (None: copied synchronously)


class HostBlockTier:
    """Host-memory KV blocks of one engine, on the engine thread only: `save` is the pool's eviction hook,
    `load` the KV manager's lower tier (the disk tier under it)."""

    def __init__(self, capacity_bytes: int, cache: KVCache, disk: DiskBlockStore | None) -> None:
        self.cache = cache
        self.block_size = cache.block_size
        self.layout = block_layout(cache)
        self.row_bytes = payload_len(cache, self.layout)
        self.capacity_rows = max(capacity_bytes // self.row_bytes, 0)
        self.disk = disk
        self.device = cache.k[0].device
        self.is_pinned = torch.cuda.is_available()  # page-locked rows: needed for truly asynchronous copies
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._slab_rows = max(1, min(self.capacity_rows, _SLAB_BYTES // self.row_bytes))
        self._slabs: list[torch.Tensor] = []
        self._num_rows = 0  # rows allocated so far (slabs grow on demand up to the capacity)
        self._free_rows: list[int] = []
        self._busy: dict[int, torch.cuda.Event] = {}  # free row -> the host->device copy still reading it
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # chain hash -> row, least recently used first
        self._stats = HostCacheStats(self.capacity_rows * self.row_bytes, self.is_pinned)
        self.pending = PendingEvictions(cache)
        # spare rows kept ready for evictions, by spilling the oldest ahead of need (with a disk tier only)
        self._reserve = max(1, min(self.capacity_rows // _RESERVE_SHARE, _RESERVE_CHUNKS * self.pending.chunk_rows))
        self._written: deque[int] = deque()  # rows the disk writer has written out and given back (its thread)
        self._num_writing = 0  # rows handed to the writer and not yet taken back from `_written`
        self._num_allocated = 0  # rows of the slabs allocated so far (the grower thread's, on CUDA)
        self._want_rows = threading.Event()
        if self.is_pinned and self.capacity_rows > 0:
            self._want_rows.set()  # the first slab now, off the engine thread
            threading.Thread(target=self._grow_loop, name="mlxcel-kv-host-grower", daemon=True).start()
        log.info("host prefix cache: up to %d blocks (%.1f GiB%s) between the KV pool and %s", self.capacity_rows,
                 self.capacity_rows * self.row_bytes / 2**30, ", pinned" if self.is_pinned else "",
                 "the disk tier" if disk is not None else "nothing (no disk tier)")

    # ---- saving (the pool's eviction hook) ----

    def save(self, blocks: list[tuple[int, int]]) -> None:
        """The pool's eviction hook: note the blocks leaving the device pool (`flush` copies them here)."""
        self.pending.add(blocks)

    def flush(self) -> None:
        """The pool's flush: the blocks noted since the last one, gathered in one batch and copied here
        (asynchronously on CUDA); past the bound the least recently used rows spill to the disk tier."""
        while self._written:
            self._free_rows.append(self._written.popleft())
            self._num_writing -= 1
        for chunk in chunks(self.pending.take(), self.pending.chunk_rows):
            self._save_chunk(chunk)
        self._spill_ahead()
        if self.is_pinned and self._num_allocated - self._num_rows + len(self._free_rows) < self._slab_rows:
            self._want_rows.set()  # less than a slab of spare rows: the grower pins the next one

    def _save_chunk(self, blocks: list[tuple[int, int]]) -> None:
        fresh: list[tuple[int, int]] = []
        for block_id, block_hash in blocks:
            if block_hash in self._entries:
                self._entries.move_to_end(block_hash)
            else:
                fresh.append((block_id, block_hash))
        if not fresh:
            return
        block_ids = [block_id for block_id, _ in fresh]
        # one batch on the compute stream (CUDA); on the CPU gathered below straight into the rows
        staged = self.pending.gather(block_ids) if self._stream is not None else None
        # rows free or not yet used; without a disk tier also those of older entries (nothing to write out first)
        room = self._spare_rows(self._row_limit()) + (len(self._entries) if self.disk is None else 0)
        overflow = len(fresh) - room
        if overflow > 0:  # more than this tier can take now: the oldest go straight to disk
            if self.disk is None:
                self._count(num_blocks_dropped=overflow)
            else:
                self._count(num_blocks_spilled=overflow)
                over = staged[:overflow] if staged is not None else self.pending.gather(block_ids[:overflow])
                self.disk.save_staged([h for _, h in fresh[:overflow]], over, self.pending)
            fresh, block_ids = fresh[overflow:], block_ids[overflow:]
            staged = staged[overflow:] if staged is not None else None
        if not fresh:
            return
        rows = self._rows_for(len(fresh))
        ready = self._copy_out(rows, staged) if staged is not None else self._gather_into_rows(rows, block_ids)
        for (_, block_hash), row in zip(fresh, rows):
            self._entries[block_hash] = _Entry(row, ready)
        self._count(num_blocks_stored=len(fresh), num_bytes_stored=len(fresh) * self.row_bytes)

    def _rows_for(self, num_rows: int) -> list[int]:
        """`num_rows` rows (as many as `_save_chunk` found room for): free ones, new ones, and without a disk
        tier those of the least recently used entries."""
        short = num_rows - self._spare_rows(self._row_limit())
        if short > 0:
            self._spill([self._entries.popitem(last=False) for _ in range(short)])
        rows = [self._free_rows.pop() for _ in range(min(num_rows, len(self._free_rows)))]
        while len(rows) < num_rows:
            rows.append(self._new_row())
        return rows

    def _spare_rows(self, limit: int) -> int:
        """Rows usable without evicting an entry: free, or not yet used up to `limit`."""
        return len(self._free_rows) + limit - self._num_rows

    def _spill_ahead(self) -> None:
        """With a disk tier: the least recently used entries go to its writer until `_reserve` rows are spare
        or on their way back (not yet pinned capacity counts as spare: the grower pins it)."""
        if self.disk is None:
            return
        num = min(self._reserve - self._spare_rows(self.capacity_rows) - self._num_writing, len(self._entries))
        self._spill([self._entries.popitem(last=False) for _ in range(max(num, 0))])

    def _row_limit(self) -> int:
        """Rows that may be used: on CUDA those of the slabs pinned so far; on the CPU (cheap, unpinned
        slabs allocated here as needed) the capacity."""
        return self._num_allocated if self.is_pinned else self.capacity_rows

    def _new_row(self) -> int:
        row = self._num_rows
        if row // self._slab_rows == len(self._slabs):  # CPU only: on CUDA the grower allocated it
            self._add_slab()
        self._num_rows += 1
        return row

    def _add_slab(self) -> None:
        num = min(self._slab_rows, self.capacity_rows - len(self._slabs) * self._slab_rows)
        self._slabs.append(torch.empty((num, self.row_bytes), dtype=torch.uint8, pin_memory=self.is_pinned))
        self._num_allocated += num  # (after the append: the engine thread reads it to bound its rows)

    def _grow_loop(self) -> None:
        """CUDA: pin the next slab when the engine thread runs short of spare rows, up to the capacity."""
        while self._num_allocated < self.capacity_rows:
            self._want_rows.wait()
            self._want_rows.clear()
            self._add_slab()

    def _row(self, row: int) -> torch.Tensor:
        return self._slabs[row // self._slab_rows][row % self._slab_rows]

    def _rows(self, row: int, num: int) -> torch.Tensor:
        """`num` consecutive rows of one slab."""
        start = row % self._slab_rows
        return self._slabs[row // self._slab_rows][start:start + num]

    def _runs(self, rows: list[int]) -> list[tuple[int, int, int]]:
        """(index, first row, count) of the runs of consecutive rows within one slab: one copy each, not one
        a block (a long prompt's blocks mostly sit in consecutive rows)."""
        runs: list[tuple[int, int, int]] = []
        for index, row in enumerate(rows):
            if runs:
                first_index, first, num = runs[-1]
                if row == first + num and row % self._slab_rows != 0:
                    runs[-1] = (first_index, first, num + 1)
                    continue
            runs.append((index, row, 1))
        return runs

    def _gather_into_rows(self, rows: list[int], block_ids: list[int]) -> None:
        """CPU: the blocks' payloads gathered straight into host `rows` (one gather a run of rows)."""
        parts = [(index, self._rows(row, num)) for index, row, num in self._runs(rows)]
        self.pending.gather_into_rows(block_ids, parts)

    def _copy_out(self, rows: list[int], data: torch.Tensor) -> torch.cuda.Event:
        """CUDA: [num_rows, row bytes] `data` (gathered on the compute stream) into host `rows` on the side stream."""
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # after the gather, not the step
        with torch.cuda.stream(self._stream):
            for busy in {id(e): e for e in (self._busy.pop(row, None) for row in rows) if e is not None}.values():
                self._stream.wait_event(busy)  # a host->device copy still reads one of these rows
            for index, row, num in self._runs(rows):
                self._rows(row, num).copy_(data[index:index + num], non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        self.pending.staged_read(ready)  # the staging buffer is gathered into again only after this copy
        return ready

    def _spill(self, victims: list[tuple[int, _Entry]], *, wait: bool = False) -> None:
        """Entries leaving this tier: their rows go to the disk tier's writer, which gives each back once written
        (`wait`: at the graceful stop, for room in its queue rather than drop); without one they are free now."""
        if not victims:
            return
        self._count(num_blocks_spilled=len(victims))
        rows = [entry.row for _, entry in victims]
        if self.disk is None:
            self._free_rows += rows
            return
        self._num_writing += len(rows)
        ready = None
        if self._stream is not None:  # after every copy queued into these rows (the side stream runs in order)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        for batch in chunks(victims, _SPILL_BATCH):  # rows go back a batch at a time, as each is written
            batch_rows = [entry.row for _, entry in batch]
            self.disk.save_payloads([(block_hash, self._row(entry.row)) for block_hash, entry in batch], wait=wait,
                                    ready=ready, done=lambda rows=batch_rows: self._written.extend(rows))

    # ---- loading (the KV manager's lower tier) ----

    def load(self, pool: BlockPool, block_hashes: list[int], hit_blocks: list[int], num_rest_tokens: int) -> list[int]:
        """The longest run of `block_hashes` held here copied into free, cached device blocks; the disk tier is
        asked for the blocks after it."""
        if not self.pending.hashes.isdisjoint(block_hashes):
            self.flush()  # evicted earlier in this step: held here once copied
        held = 0
        while held < len(block_hashes) and block_hashes[held] in self._entries:
            held += 1
        run = block_hashes[:max(min(held, available_room(pool, hit_blocks, num_rest_tokens, held)), 0)]
        if not run:
            self._count(num_misses=1)
        block_ids = self._load_run(pool, run, hit_blocks) if run else []
        if len(run) == held < len(block_hashes) and self.disk is not None:
            block_ids += self.disk.load(pool, block_hashes[held:], hit_blocks + block_ids,
                                        num_rest_tokens - held * self.block_size)
        return block_ids

    def _load_run(self, pool: BlockPool, run: list[int], hit_blocks: list[int]) -> list[int]:
        started = time.perf_counter()
        entries = [self._entries.pop(block_hash) for block_hash in run]  # out of the LRU: evictions spare them
        pool.touch(hit_blocks)  # NOTE: the allocation below must not evict the device hits before them
        block_ids = pool.allocate(len(entries))  # its evictions come back here through `save`
        pool.flush_evictions()  # ... and are gathered before the scatter below overwrites them
        pool.free(hit_blocks[::-1])
        scatter_payloads(self.cache, block_ids, self._copy_in(entries), self.layout)
        for block_id, block_hash in zip(block_ids, run):
            pool.cache_block(block_id, block_hash)
        pool.free(block_ids[::-1])  # unused now, cached until the request touches them
        self._count(num_hits=1, num_blocks_loaded=len(entries), num_bytes_loaded=len(entries) * self.row_bytes,
                    load_seconds=time.perf_counter() - started)
        return block_ids

    def _copy_in(self, entries: list[_Entry]) -> torch.Tensor:
        """The entries' rows on the device, copied on the compute stream; their rows are free again after."""
        data = torch.empty((len(entries), self.row_bytes), dtype=torch.uint8, device=self.device)
        if self._stream is None:
            for index, row, num in self._runs([entry.row for entry in entries]):
                data[index:index + num].copy_(self._rows(row, num))
            self._free_rows += [entry.row for entry in entries]
            return data
        stream = torch.cuda.current_stream(self.device)
        for ready in {id(e.ready): e.ready for e in entries if e.ready is not None}.values():
            stream.wait_event(ready)
        for index, row, num in self._runs([entry.row for entry in entries]):
            data[index:index + num].copy_(self._rows(row, num), non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        for entry in entries:
            self._busy[entry.row] = done
            self._free_rows.append(entry.row)
        return data

    # ---- reset, stop, stats ----

    def reset(self) -> int:
        """POST /v1/cache/reset: forget every block held here; how many."""
        num = len(self._entries)
        self.pending.take()
        self._free_rows += [entry.row for entry in self._entries.values()]
        self._entries.clear()
        return num

    def close(self) -> None:
        """Graceful stop: the most recently used blocks (as many as the disk tier holds) go to its writer,
        before the device pool's own blocks so those count as the newer."""
        self.flush()
        if self.disk is None or not self._entries:
            return
        most = self.disk.config.capacity_bytes // self.row_bytes
        victims = list(self._entries.items())[-most:] if most > 0 else []
        self._spill(victims, wait=True)
        self._entries.clear()

    def stats(self) -> HostCacheStats:
        num = len(self._entries)
        return replace(self._stats, num_blocks=num, size_bytes=num * self.row_bytes)

    def _count(self, **deltas: float) -> None:
        stats = self._stats
        self._stats = replace(stats, **{name: getattr(stats, name) + delta for name, delta in deltas.items()})


def open_host_tier(capacity_bytes: int, cache: KVCache, pool: BlockPool,
                   disk: DiskBlockStore | None) -> HostBlockTier | None:
    """The host tier wired under a pool (device evictions go to it, it spills to `disk`); None when the bound
    holds no block."""
    tier = HostBlockTier(capacity_bytes, cache, disk)
    if tier.capacity_rows == 0:
        return None
    pool.on_evict, pool.on_flush = tier.save, tier.flush
    return tier
