"""The prefix cache's disk tier (issue 29): full KV blocks in files that outlive the process.

A block's file is keyed by the chain hash the RAM cache uses (which already covers the tokens, the
block size and the LoRA scales) under a directory named by the KV *identity*: everything else that
makes KV differ (model file, tokenizer, activation dtype, KV element types, LoRA adapters, RoPE).
Blocks go to disk when an allocation evicts them from RAM and, at a graceful stop, every block
still cached; the engine thread only copies the block's rows, a writer thread checksums and writes
each file (temp name + rename, so readers and other servers never see half a file). On a RAM miss
the KV manager asks `load`, which reads the stored run into free blocks when loading measured
faster than recomputing. A file that fails any check is never used: skipped, deleted, one log line.
A write that fails (read-only or full directory) turns writing off with one warning: RAM-only.

A block may have a sidecar file beside it (issue 41: a hybrid model's recurrent-state snapshot at the
block's end, `SIDECAR_SUFFIX`, engine/kv/states.py): `sidecar(hash)` is asked on the engine thread as
the block is handed to the writer, which writes it with the block, and a snapshot evicted from RAM
before its block goes to disk alone (`save_sidecar`), so a killed server still finds the snapshots of
the blocks it wrote. Sidecars count in the capacity and are evicted with their blocks.

The eviction hook only notes the blocks; at the pool's flush (before any KV write, evict.py) they are
gathered in one batch into rows of a bounded host ring allocated up front (pinned on CUDA, copied there by a
side stream), and the writer builds, checksums and writes each file, then hands the rows back. When the
ring or the writer's queue is full the blocks are dropped (counted), never waited for. With the host-memory
tier on (host.py, issue 29 point 5) device evictions go to it instead and only its spills come here
(`save_payloads` / `save_staged`, the same byte layout: a block = its file payload).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import secrets
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from mlxcel.engine.kv.blocks import BlockPool
from mlxcel.engine.kv.evict import PendingEvictions, chunks, gather_into
from mlxcel.engine.kv.tensors import KVCache
from mlxcel.types import DiskCacheStats

log = logging.getLogger(__name__)

MAGIC = b"MLXCELKV"
FORMAT_VERSION = 1
SUFFIX = ".kvb"
SIDECAR_SUFFIX = ".rstate"  # a block's recurrent-state snapshot (safetensors), written and evicted with it
_HEADER_LEN = struct.Struct("<I")
_QUEUE_BATCHES = 64  # eviction batches waiting for the writer; past it a batch is dropped, never waited for
_EMA = 0.3  # weight of the newest measurement in the load / prefill rates
_STALE_TEMP_S = 3600.0  # a temp file this old belongs to a writer that died
_RING_BYTES = {"cuda": 256 << 20, "cpu": 64 << 20}  # host rows for blocks on their way to the writer (pinned on
# CUDA, allocated up front; on the CPU its pages count in the server's resident memory once touched)


class _HostRing:
    """A ring of host rows, one block payload each: the engine thread takes rows at the head, the writer
    gives them back in the same (queue) order."""

    def __init__(self, num_rows: int, row_bytes: int, pinned: bool) -> None:
        self.rows = torch.empty((num_rows, row_bytes), dtype=torch.uint8, pin_memory=pinned)
        self._taken = 0  # rows ever taken (engine thread)
        self._given_back = 0  # rows ever given back (writer thread; an int store is atomic)

    def take(self, num: int) -> list[tuple[int, int]]:
        """Up to `num` rows as (first, count) runs (two where the ring wraps); fewer when the writer is behind."""
        size = len(self.rows)
        num = min(num, size - (self._taken - self._given_back))
        first = self._taken % size
        self._taken += num
        return [(first, num)] if first + num <= size else [(first, size - first), (0, first + num - size)]

    def give_back(self, num: int) -> None:
        self._given_back += num


@dataclass(slots=True)
class _WriteBatch:
    """Blocks for the writer: their payloads (uint8 CPU rows: of the ring, or host-tier spills), the event of
    the device->host copy into them (CUDA) and how many ring rows to give back once written."""

    hashes: list[int]
    payloads: list[torch.Tensor | None]  # None: a sidecar alone (a state snapshot evicted from RAM before its block)
    ready: torch.cuda.Event | None = None
    num_ring_rows: int = 0
    done: Callable[[], None] | None = None  # the payloads are no longer read: written, or dropped (host-tier rows)
    sidecars: list[dict[str, torch.Tensor] | None] | None = None  # each block's sidecar tensors (CPU), if any


@dataclass(slots=True)
class _Reset:
    """POST /v1/cache/reset for the writer: it deletes this identity's files, then sets `done`."""

    done: threading.Event = field(default_factory=threading.Event)
    num_ring_rows: int = 0  # of the dropped batches: given back by the writer, after the batch it is writing
    num_files: int = 0
    num_bytes: int = 0


class BadBlockFile(ValueError):
    """A block file that must not be used (its reason is the message)."""


@dataclass(frozen=True, slots=True)
class DiskTierConfig:
    directory: Path  # --prefix-cache-dir
    capacity_bytes: int  # --prefix-cache-disk-size: LRU (by last use) past it
    identity: str  # hex digest of what makes KV differ beyond the chain hash


@dataclass(slots=True)
class LoadPolicy:
    """Load or recompute: both rates measured here (load per block, prefill per token), newest weighted.

    Until both are known, loading wins: on the CPU it is faster by orders of magnitude, and the first
    load measures itself."""

    load_s_per_block: float | None = None
    prefill_s_per_token: float | None = None

    def should_load(self, block_size: int) -> bool:
        if self.load_s_per_block is None or self.prefill_s_per_token is None:
            return True
        return self.load_s_per_block < block_size * self.prefill_s_per_token

    def record_load(self, num_blocks: int, seconds: float) -> None:
        self.load_s_per_block = _ema(self.load_s_per_block, seconds / num_blocks)

    def record_prefill(self, num_tokens: int, seconds: float) -> None:
        self.prefill_s_per_token = _ema(self.prefill_s_per_token, seconds / num_tokens)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EMA) * old + _EMA * new


class DiskBlockStore:
    """The disk tier of one engine: its files, its writer thread and its counters.

    `save` (the pool's eviction hook), `load` (the KV manager's lower tier), `observe_prefill` and
    `close` run on the engine thread; the writer thread only writes and deletes files."""

    def __init__(self, config: DiskTierConfig, cache: KVCache) -> None:
        self.config = config
        self.cache = cache
        self.block_size = cache.block_size
        self.folder = config.directory / config.identity[:32]
        self.policy = LoadPolicy()
        self.layout = block_layout(cache)  # (name, bytes per layer of one block) in file order
        self._stats = DiskCacheStats(str(config.directory), config.capacity_bytes)
        self._lock = threading.Lock()
        self._known: set[int] = set()  # chain hashes with a file here (this process's view)
        self._size_bytes = 0
        self._queue: queue.Queue[_WriteBatch | _Reset | None] = queue.Queue(_QUEUE_BATCHES)
        self.pending = PendingEvictions(cache)
        self.is_pinned = cache.k[0].device.type == "cuda"
        ring_bytes = _RING_BYTES["cuda" if self.is_pinned else "cpu"]
        self._ring = _HostRing(max(1, min(ring_bytes, config.capacity_bytes) // self.pending.row_bytes),
                               self.pending.row_bytes, self.is_pinned)
        self._stream = torch.cuda.Stream(cache.k[0].device) if self.is_pinned else None
        self._is_writable = self._prepare_folder()
        # A block's sidecar tensors, asked on the engine thread (a hybrid's state snapshot: EngineCore sets it)
        self.sidecar: Callable[[int], dict[str, torch.Tensor] | None] | None = None
        self._writer = threading.Thread(target=self._write_loop, name="mlxcel-kv-disk", daemon=True)
        self._writer.start()
        log.info("disk prefix cache: %s (%d blocks, %.1f MiB of %.1f GiB; %s)", self.folder, len(self._known),
                 self._size_bytes / 2**20, config.capacity_bytes / 2**30,
                 "read-write" if self._is_writable else "read-only")

    # ---- startup ----

    def _prepare_folder(self) -> bool:
        """Create the folder, index its files and check it takes writes; False (one warning) if not."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("disk prefix cache: cannot create %s (%s); caching in RAM only", self.folder, exc)
            return False
        self._scan()
        try:
            probe = self.folder / f".probe.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            log.warning("disk prefix cache: %s is not writable (%s); reading it, caching new blocks in RAM only",
                        self.folder, exc)
            return False
        return True

    def _scan(self) -> None:
        self._size_bytes = sum(size for _, size, _ in _block_files(self.config.directory))
        for path in self.folder.glob(f"*{SUFFIX}"):
            try:
                self._known.add(int(path.stem, 16))
            except ValueError:
                continue
        _remove_stale_temps(self.folder)

    # ---- engine thread: saving ----

    def save(self, blocks: list[tuple[int, int]]) -> None:
        """The pool's eviction hook: note the blocks leaving RAM; `flush` gathers them before their KV is
        overwritten."""
        if self._is_writable:
            self.pending.add([(b, h) for b, h in blocks if h not in self._known])

    def flush(self) -> None:
        """The pool's flush: the blocks noted since the last one, gathered in one batch and handed to the writer."""
        blocks = self.pending.take()
        for chunk in chunks(blocks, self.pending.chunk_rows):
            self._save_chunk(chunk)

    def _save_chunk(self, blocks: list[tuple[int, int]]) -> None:
        runs = self._take_rows(len(blocks))
        num = sum(count for _, count in runs)
        blocks = blocks[:num]  # the rest: dropped by _take_rows
        if not blocks:
            return
        block_ids = [block_id for block_id, _ in blocks]
        if self._stream is None:  # CPU: gathered straight into the ring's rows
            self.pending.gather_into_rows(block_ids, self._ring_parts(runs))
            self._enqueue_rows([h for _, h in blocks], runs, None)
        else:
            self._copy_staged([h for _, h in blocks], self.pending.gather(block_ids), runs, self.pending)

    def save_staged(self, block_hashes: list[int], staged: torch.Tensor, pending: PendingEvictions) -> None:
        """Payloads `pending` gathered on the device ([n, row bytes], current stream) to the writer (the host
        tier's overflow); those the ring has no room for are dropped."""
        fresh = [i for i, h in enumerate(block_hashes) if h not in self._known]
        if not fresh or not self._is_writable:
            return
        runs = self._take_rows(len(fresh))
        num = sum(count for _, count in runs)
        staged = staged[fresh[:num]] if len(fresh) < len(block_hashes) else staged[:num]
        hashes = [block_hashes[i] for i in fresh[:num]]
        if self._stream is None:
            for index, rows in self._ring_parts(runs):
                rows.copy_(staged[index:index + len(rows)])
            self._enqueue_rows(hashes, runs, None)
        elif hashes:
            self._copy_staged(hashes, staged, runs, pending)

    def _take_rows(self, num: int) -> list[tuple[int, int]]:
        """Ring rows for `num` blocks when the writer's queue has room; what is not granted is counted dropped."""
        runs = [] if self._queue.full() else [run for run in self._ring.take(num) if run[1] > 0]
        dropped = num - sum(count for _, count in runs)
        if dropped:
            self._count(num_blocks_dropped=dropped)  # the writer is behind: recomputed later, never waited for
        return runs

    def _copy_staged(self, hashes: list[int], staged: torch.Tensor, runs: list[tuple[int, int]],
                     pending: PendingEvictions) -> None:
        """CUDA: the side stream copies the staged rows into the ring after the gather; the writer waits on it."""
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(staged.device))  # after the gather, not the step
        with torch.cuda.stream(self._stream):
            for index, rows in self._ring_parts(runs):
                rows.copy_(staged[index:index + len(rows)], non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        pending.staged_read(ready)  # the staging buffer is reused only after this copy
        staged.record_stream(self._stream)  # (a subset of it is a fresh tensor: kept until the copy is done)
        self._enqueue_rows(hashes, runs, ready)

    def _ring_parts(self, runs: list[tuple[int, int]]) -> list[tuple[int, torch.Tensor]]:
        """The ring's rows of `runs` as (index of their first block in the batch, rows [count, row bytes])."""
        starts = itertools.accumulate((count for _, count in runs), initial=0)
        return [(start, self._ring.rows[first:first + count]) for start, (first, count) in zip(starts, runs)]

    def _enqueue_rows(self, hashes: list[int], runs: list[tuple[int, int]], ready: torch.cuda.Event | None) -> None:
        rows = [self._ring.rows[first + i] for first, count in runs for i in range(count)]
        self._queue.put_nowait(_WriteBatch(hashes, rows, ready, len(rows), sidecars=self._sidecars(hashes)))

    def save_sidecar(self, block_hash: int, tensors: dict[str, torch.Tensor]) -> None:
        """A sidecar leaving RAM before its block does (a state snapshot the pool evicts): written alone, found
        by its block's hash when the block comes back (or dropped with the others when the writer is behind)."""
        if self._is_writable:
            self._enqueue(_WriteBatch([block_hash], [None], sidecars=[tensors]))

    def _sidecars(self, hashes: list[int]) -> list[dict[str, torch.Tensor] | None] | None:
        """The blocks' sidecar tensors, copied now (the engine thread owns what they are read from)."""
        if self.sidecar is None:
            return None
        return [self.sidecar(block_hash) for block_hash in hashes]

    def save_payloads(self, blocks: list[tuple[int, torch.Tensor]], *, wait: bool = False,
                      ready: torch.cuda.Event | None = None, done: Callable[[], None] | None = None) -> None:
        """Hand whole block payloads (chain hash, uint8 CPU tensor) to the writer: the host tier's spills, read
        after `ready` (the copies into them) and given back by calling `done` once written or dropped (`wait`: at
        the graceful stop, for room in the queue rather than drop)."""
        fresh = [(block_hash, payload) for block_hash, payload in blocks if block_hash not in self._known]
        if fresh and self._is_writable:
            hashes = [h for h, _ in fresh]
            self._enqueue(_WriteBatch(hashes, [p for _, p in fresh], ready, done=done, sidecars=self._sidecars(hashes)),
                          wait=wait)
        elif done is not None:
            done()

    def _enqueue(self, batch: _WriteBatch, *, wait: bool = False) -> None:
        if wait:
            self._queue.put(batch)
            return
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self._count(num_blocks_dropped=len(batch.hashes))  # the writer is behind: recomputed later
            if batch.done is not None:
                batch.done()

    def reset(self, timeout: float = 60.0) -> tuple[int, int]:
        """Delete this identity's block files (POST /v1/cache/reset): files and bytes deleted.

        Pending writes are dropped first, then the writer itself deletes, so no block saved before the
        reset can land after it; the engine thread waits for it (up to `timeout`)."""
        self.pending.take()
        request = _Reset()
        while True:
            try:
                item = self._queue.get_nowait()  # (never the stop sentinel: close runs on this thread too)
            except queue.Empty:
                break
            if isinstance(item, _WriteBatch):  # NOTE: the ring gives rows back in order: not before the writer's
                request.num_ring_rows += item.num_ring_rows
                if item.done is not None:  # (the writer never saw it: its rows are not read)
                    item.done()
        self._queue.put(request)
        if not request.done.wait(timeout):
            log.warning("disk prefix cache: the reset did not finish in %.0f s", timeout)
        return request.num_files, request.num_bytes

    def close(self, pool: BlockPool, timeout: float = 60.0) -> None:
        """Graceful stop: save the blocks still cached, most recently used first and no more than the capacity
        holds, then let the writer finish (up to `timeout`)."""
        self.flush()
        most = self.config.capacity_bytes // self._most_file_bytes()  # headers too: else the bound drops the oldest
        fresh = [(b, h) for b, h in pool.cached_blocks()[:most] if h not in self._known]
        for batch in chunks(fresh, 64) if self._is_writable else []:
            data = torch.empty((len(batch), self.pending.row_bytes), dtype=torch.uint8, device=self.cache.k[0].device)
            gather_into(self.cache, [b for b, _ in batch], data)
            hashes = [h for _, h in batch]
            self._queue.put(_WriteBatch(hashes, list(data.cpu()), sidecars=self._sidecars(hashes)))
        self._queue.put(None)
        self._writer.join(timeout)
        if self._writer.is_alive():
            log.warning("disk prefix cache: the writer did not finish in %.0f s; some blocks were not saved", timeout)

    # ---- engine thread: loading ----

    def load(self, pool: BlockPool, block_hashes: list[int], hit_blocks: list[int], num_rest_tokens: int) -> list[int]:
        """The longest stored run of `block_hashes` read into free blocks, registered and freed (cached)."""
        run = self._stored_run(block_hashes)
        reserve = -(-min(num_rest_tokens - len(run) * self.block_size, 2048) // self.block_size) + 1
        room = pool.num_free_blocks - sum(pool.blocks[b].ref_count == 0 for b in hit_blocks) - reserve
        run = run[:max(room, 0)]
        if not run:
            self._count(num_misses=1)
            return []
        if not self.policy.should_load(self.block_size):
            self._count(num_skipped=1)
            return []
        return self._load_run(pool, run, hit_blocks)

    def _stored_run(self, block_hashes: list[int]) -> list[int]:
        run: list[int] = []
        for block_hash in block_hashes:
            if block_hash not in self._known and not self._path(block_hash).is_file():
                break  # (a file another server wrote since we started counts too)
            run.append(block_hash)
        return run

    def _load_run(self, pool: BlockPool, run: list[int], hit_blocks: list[int]) -> list[int]:
        started = time.perf_counter()
        payloads = self._read_run(run)
        if not payloads:
            self._count(num_misses=1)
            return []
        pool.touch(hit_blocks)  # NOTE: the allocation below must not evict the RAM hits before them
        block_ids = pool.allocate(len(payloads))
        pool.flush_evictions()  # what that allocation evicted is gathered before the scatter overwrites it
        pool.free(hit_blocks[::-1])
        _scatter(self.cache, block_ids, payloads, self.layout)
        for block_id, block_hash in zip(block_ids, run):
            pool.cache_block(block_id, block_hash)
        pool.free(block_ids[::-1])  # unused now, cached until a request touches them
        seconds = time.perf_counter() - started
        self.policy.record_load(len(payloads), seconds)
        self._count(num_hits=1, num_blocks_read=len(payloads), load_seconds=seconds,
                    num_bytes_read=sum(len(p) for p in payloads))
        return block_ids

    def _read_run(self, run: list[int]) -> list[memoryview]:
        """The checked payloads of `run`'s files, up to the first missing or bad one (which is deleted)."""
        payloads: list[memoryview] = []
        for block_hash in run:
            path = self._path(block_hash)
            try:
                payloads.append(self._read(path, block_hash))
                os.utime(path)  # last use: the capacity bound evicts the least recently used first
            except FileNotFoundError:
                self._known.discard(block_hash)  # evicted by this or another server meanwhile
                break
            except (OSError, BadBlockFile) as exc:
                self._drop_bad(path, block_hash, exc)
                break
            self._known.add(block_hash)
        return payloads

    def _read(self, path: Path, block_hash: int) -> memoryview:
        with open(path, "rb") as file:  # read into a bytearray: the payload is then a view, never copied
            data = bytearray(os.fstat(file.fileno()).st_size)
            num_read = file.readinto(data)
        if num_read != len(data):
            raise BadBlockFile("truncated while read")
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _HEADER_LEN.size:
            raise BadBlockFile("not a block file")
        (header_len,) = _HEADER_LEN.unpack_from(data, len(MAGIC))
        start = len(MAGIC) + _HEADER_LEN.size
        try:
            header = json.loads(data[start:start + header_len])
        except ValueError:
            raise BadBlockFile("unreadable header") from None
        payload = memoryview(data)[start + header_len:]
        self._check(header, payload, block_hash)
        return payload

    def _check(self, header: dict, payload: memoryview, block_hash: int) -> None:
        expected = {"version": FORMAT_VERSION, "identity": self.config.identity, "hash": f"{block_hash:064x}",
                    "block_size": self.block_size, "layout": [list(item) for item in self.layout]}
        for key, value in expected.items():
            if header.get(key) != value:
                raise BadBlockFile(f"its {key} does not match")
        if len(payload) != header.get("payload_len") or len(payload) != payload_len(self.cache, self.layout):
            raise BadBlockFile("truncated")
        if zlib.crc32(payload) != header.get("crc32"):
            raise BadBlockFile("checksum mismatch")

    def _drop_bad(self, path: Path, block_hash: int, reason: Exception) -> None:
        log.warning("disk prefix cache: ignored and removed %s (%s)", path, reason)
        self._known.discard(block_hash)
        self._count(num_bad_files=1)
        try:
            path.unlink()
        except OSError:
            pass  # already gone, or a read-only folder: skipped either way

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A finished request's computed prompt tokens and the time they took (the crossover's other side)."""
        if num_tokens >= self.block_size and seconds > 0:
            self.policy.record_prefill(num_tokens, seconds)

    # ---- writer thread ----

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, _Reset):
                self._ring.give_back(item.num_ring_rows)
                self._delete_all(item)
                continue
            if item.ready is not None:
                item.ready.synchronize()  # the side stream's copy into the ring (or host-tier) rows
            sidecars = item.sidecars or [None] * len(item.hashes)
            try:
                for block_hash, payload, sidecar in zip(item.hashes, item.payloads, sidecars):
                    if self._is_writable and payload is not None:
                        self._write(block_hash, payload.numpy().tobytes())
                    if self._is_writable and sidecar is not None:
                        self._write_sidecar(block_hash, sidecar)
            finally:
                if item.done is not None:
                    item.done()
            self._ring.give_back(item.num_ring_rows)
            if self._size_bytes > self.config.capacity_bytes:
                self._enforce_capacity()

    def _delete_all(self, request: _Reset) -> None:
        """This identity's block files only: another model sharing the directory keeps its own."""
        try:
            for path in [*self.folder.glob(f"*{SUFFIX}"), *self.folder.glob(f"*{SIDECAR_SUFFIX}")]:
                try:
                    size = path.stat().st_size
                    path.unlink()
                except OSError:
                    continue  # gone meanwhile, or a read-only folder
                request.num_files += 1
                request.num_bytes += size
            self._known.clear()
            self._size_bytes = max(self._size_bytes - request.num_bytes, 0)
        finally:
            request.done.set()

    def _header(self, block_hash: int, payload_len: int, crc32: int) -> bytes:
        return json.dumps({"version": FORMAT_VERSION, "identity": self.config.identity,
                           "hash": f"{block_hash:064x}", "block_size": self.block_size,
                           "layout": [list(item) for item in self.layout], "payload_len": payload_len,
                           "crc32": crc32}).encode()

    def _most_file_bytes(self) -> int:
        """The largest a block file can be (its header's crc32 takes up to 10 digits)."""
        most = payload_len(self.cache, self.layout)
        return len(MAGIC) + _HEADER_LEN.size + len(self._header(0, most, 2**32 - 1)) + most

    def _write(self, block_hash: int, payload: bytes) -> None:
        path = self._path(block_hash)
        if path.exists():
            self._known.add(block_hash)
            return
        header = self._header(block_hash, len(payload), zlib.crc32(payload))
        temp = path.with_name(f".{path.stem[:16]}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            with open(temp, "wb") as file:
                file.write(MAGIC + _HEADER_LEN.pack(len(header)) + header)
                file.write(payload)
            os.replace(temp, path)  # atomic: readers and other servers see the whole file or none
        except OSError as exc:
            self._fail_writes(temp, exc)
            return
        size = path.stat().st_size
        self._known.add(block_hash)
        self._size_bytes += size
        self._count(num_blocks_written=1, num_bytes_written=size)

    def _write_sidecar(self, block_hash: int, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        path = self._path(block_hash).with_suffix(SIDECAR_SUFFIX)
        if path.exists():
            return
        temp = path.with_name(f".{path.stem[:16]}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            save_file(tensors, str(temp))
            os.replace(temp, path)
        except OSError as exc:
            self._fail_writes(temp, exc)
            return
        self._size_bytes += path.stat().st_size

    def _fail_writes(self, temp: Path, exc: OSError) -> None:
        self._is_writable = False
        self._count(num_write_errors=1)
        temp.unlink(missing_ok=True)
        log.warning("disk prefix cache: writing to %s failed (%s); caching in RAM only from now on", self.folder, exc)

    def _enforce_capacity(self) -> None:
        """Delete the least recently used block files (all identities) until 90 % of the capacity is left."""
        files = sorted(_block_files(self.config.directory), key=lambda item: item[2])
        total = sum(size for _, size, _ in files)
        target = self.config.capacity_bytes * 0.9
        for path, size, _ in files:
            if total <= target:
                break
            try:
                path.unlink()
            except FileNotFoundError:
                pass  # another server evicted it first
            except OSError:
                continue
            path.with_suffix(SIDECAR_SUFFIX).unlink(missing_ok=True)  # a block's sidecar goes with it
            total -= size
            if path.parent == self.folder:
                self._known.discard(int(path.stem, 16))
        self._size_bytes = total

    # ---- both ----

    def _path(self, block_hash: int) -> Path:
        return self.folder / f"{block_hash:064x}{SUFFIX}"

    def _count(self, **deltas: float) -> None:
        with self._lock:  # both threads count
            stats = self._stats
            self._stats = replace(stats, **{name: getattr(stats, name) + delta for name, delta in deltas.items()})

    def stats(self) -> DiskCacheStats:
        known = len(self._known)
        return replace(self._stats, is_writable=self._is_writable, num_files=known, size_bytes=self._size_bytes)


def block_layout(cache: KVCache) -> list[tuple[str, int]]:
    """Each cache tensor's name and the bytes one block of it takes in one layer."""
    return [(name, cache.block_size * tensors[0][0].numel() * tensors[0].element_size())
            for name, tensors in cache.named_tensors().items()]


def payload_len(cache: KVCache, layout: list[tuple[str, int]]) -> int:
    """Bytes of one block's payload: each tensor's block bytes over its layers (all of them, or those of
    one head shape: KVCache.layer_shapes)."""
    layers = [len(tensors) for tensors in cache.named_tensors().values()]
    return sum(size * num for (_, size), num in zip(layout, layers))


def _scatter(cache: KVCache, block_ids: list[int], payloads: list[memoryview],
             layout: list[tuple[str, int]]) -> None:
    """Write the payloads' rows into `block_ids` of every cache tensor (the inverse of evict.gather_into)."""
    data = torch.empty(len(payloads), len(payloads[0]), dtype=torch.uint8)
    for index, payload in enumerate(payloads):
        data[index] = torch.frombuffer(payload, dtype=torch.uint8)
    scatter_payloads(cache, block_ids, data, layout)


def scatter_payloads(cache: KVCache, block_ids: list[int], data: torch.Tensor,
                     layout: list[tuple[str, int]]) -> None:
    """Write [num_blocks, payload bytes] `data` (any device) into `block_ids` of every cache tensor."""
    size, num_blocks = cache.block_size, len(block_ids)
    slots = torch.tensor([b * size + i for b in block_ids for i in range(size)]).to(cache.k[0].device)
    data = data.to(cache.k[0].device)
    # [num_blocks, payload bytes] -> per tensor [num_layers, num_blocks, block bytes]
    offset = 0
    for (name, block_bytes), tensors in zip(layout, cache.named_tensors().values()):
        num_layers = len(tensors)
        part = data[:, offset:offset + num_layers * block_bytes].view(num_blocks, num_layers, block_bytes)
        offset += num_layers * block_bytes
        for layer, target in enumerate(tensors):
            rows = part[:, layer].reshape(num_blocks * size, -1).view(target.dtype).view(-1, *target.shape[1:])
            target.index_copy_(0, slots, rows)


def _block_files(directory: Path) -> list[tuple[Path, int, float]]:
    """Every block file under `directory` (all identities): path, size with its sidecar's, last use. A sidecar
    without its block (a snapshot saved at a graceful stop, its block's file evicted) is an entry of its own."""
    files: dict[Path, tuple[Path, int, float]] = {}
    for path in [*directory.glob(f"*/*{SUFFIX}"), *directory.glob(f"*/*{SIDECAR_SUFFIX}")]:
        try:
            info = path.stat()
        except OSError:
            continue
        key = path.with_suffix("")
        first, size, used = files.get(key, (path, 0, 0.0))
        files[key] = (first if first.suffix == SUFFIX else path, size + info.st_size, max(used, info.st_mtime))
    return list(files.values())


def _remove_stale_temps(folder: Path) -> None:
    now = time.time()
    for path in folder.glob(".*.tmp"):
        try:
            if now - path.stat().st_mtime > _STALE_TEMP_S:
                path.unlink()
        except OSError:
            continue


def open_disk_tier(config: DiskTierConfig, cache: KVCache, pool: BlockPool) -> DiskBlockStore:
    """The disk tier wired under a pool: evictions are saved through it."""
    store = DiskBlockStore(config, cache)
    pool.on_evict, pool.on_flush = store.save, store.flush
    return store
