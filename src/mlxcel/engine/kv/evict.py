"""Evicted KV blocks gathered once per engine step (issue 25 point 2 / issue 29 point 5 follow-up).

The pool's eviction hook only notes the evicted (block id, chain hash) pairs (`PendingEvictions.add`); the
tier that owns the hook gathers them when the pool is flushed (`BlockPool.flush_evictions`), which the engine
does before any KV write: before the step's forward and before a lower tier or a slot file scatters into
fresh blocks. The gather is one index_select per cache tensor (all layers and blocks at once) into a
preallocated staging buffer, queued on the current (compute) stream: so it runs before any later kernel that
overwrites those blocks, and the engine thread never waits for it. On CUDA a side stream then copies the
staged rows to host memory, an event marking them ready for the writer thread.
"""

from __future__ import annotations

import torch

from mlxcel.engine.kv.tensors import KVCache

_STAGING_BYTES = 64 << 20  # device staging of one gather (two on CUDA, used in turn); a bigger burst is chunked
_CPU_CHUNK_BYTES = 16 << 20  # on the CPU the gather's scratch is resident memory: a smaller chunk


def payload_bytes(cache: KVCache) -> int:
    """Bytes of one block's payload (disk.py's file layout: per cache tensor, its layers one after another)."""
    return sum(t.shape[0] * cache.block_size * t[0, 0].numel() * t.element_size()
               for t in cache.stacked_tensors().values())


def gather_into(cache: KVCache, block_ids: list[int], out: torch.Tensor,
                scratch: dict[str, torch.Tensor] | None = None) -> None:
    """The blocks' payloads into `out` [len(block_ids), payload bytes] (same device as the cache): per cache
    tensor one index_select over all layers (and a copy into its columns when the cache has several; through
    `scratch`, name -> a reusable byte buffer, when given: a fresh one page-faults on the CPU)."""
    if not block_ids:
        return
    device, size = out.device, cache.block_size
    ids = torch.tensor(block_ids, device=device)
    offset = 0
    for name, stacked in cache.stacked_tensors().items():
        num_layers, num_rows = stacked.shape[0], stacked.shape[1] // size  # (the cache's slots are whole blocks)
        rows = stacked.view(torch.uint8).reshape(num_layers * num_rows, -1)  # one row of bytes per (layer, block)
        # index[b, layer] = layer * num_rows + block b: a block's layers one after another
        index = (torch.arange(num_layers, device=device)[None, :] * num_rows + ids[:, None]).reshape(-1)
        width = num_layers * rows.shape[1]
        part = out[:, offset:offset + width]
        if part.is_contiguous():
            torch.index_select(rows, 0, index, out=part.view(-1, rows.shape[1]))
        elif scratch is not None and scratch[name].numel() >= index.numel() * rows.shape[1]:
            picked = scratch[name][:index.numel() * rows.shape[1]].view(-1, rows.shape[1])
            torch.index_select(rows, 0, index, out=picked)
            part.copy_(picked.view(len(block_ids), width))
        else:
            part.copy_(rows.index_select(0, index).view(len(block_ids), width))
        offset += width


class PendingEvictions:
    """The blocks evicted since the last flush, and the staging buffers they are gathered into."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.row_bytes = payload_bytes(cache)
        self.device = cache.k[0].device
        self.blocks: list[tuple[int, int]] = []
        self.hashes: set[int] = set()
        self.num_gathers = 0  # index_select batches issued (tests: one per flush of a burst)
        self.chunk_rows = max(1, (_STAGING_BYTES if self.device.type == "cuda" else _CPU_CHUNK_BYTES) // self.row_bytes)
        self._staging: list[torch.Tensor] = []  # allocated on first use: a tier that never evicts costs nothing
        self.scratch: dict[str, torch.Tensor] | None = None  # the CPU's per-tensor gather buffers (`gather_into`)
        self._reads: list[list[torch.cuda.Event]] = [[], []]  # the side streams' copies still reading each
        self._turn = 0

    def add(self, blocks: list[tuple[int, int]]) -> None:
        """The pool's eviction hook: O(1) a block, nothing copied yet."""
        self.blocks += blocks
        self.hashes.update(block_hash for _, block_hash in blocks)

    def take(self) -> list[tuple[int, int]]:
        blocks, self.blocks = self.blocks, []
        self.hashes.clear()
        return blocks

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """[len(block_ids) <= chunk_rows, row bytes] staged payloads on the cache's device, queued on the current
        stream; on CUDA call `staged_read` with the event of the copy that reads them."""
        if not self._staging:
            num = 2 if self.device.type == "cuda" else 1
            self._staging = [torch.empty((self.chunk_rows, self.row_bytes), dtype=torch.uint8, device=self.device)
                             for _ in range(num)]
        self._turn = (self._turn + 1) % len(self._staging)
        for read in self._reads[self._turn]:  # GPU-side wait (no host sync): the copies out of this buffer
            torch.cuda.current_stream(self.device).wait_event(read)  # two gathers ago, long done in practice
        self._reads[self._turn] = []
        out = self._staging[self._turn][:len(block_ids)]
        gather_into(self.cache, block_ids, out, self.cpu_scratch())
        self.num_gathers += 1
        return out

    def gather_into_rows(self, block_ids: list[int], parts: list[tuple[int, torch.Tensor]]) -> None:
        """CPU: the blocks' payloads gathered straight into host rows, one batch: `parts` are (index of the
        first of `block_ids`, rows [n, row bytes] for it and the next n - 1), in order."""
        for start, rows in parts:
            gather_into(self.cache, block_ids[start:start + len(rows)], rows, self.cpu_scratch())
        self.num_gathers += 1

    def cpu_scratch(self) -> dict[str, torch.Tensor] | None:
        """Reusable per-tensor buffers of one chunk (CPU only: on CUDA the caching allocator reuses memory)."""
        if self.scratch is None and self.device.type == "cpu":
            self.scratch = {name: torch.empty(self.chunk_rows * t.shape[0] * self.cache.block_size * t[0, 0].numel()
                                              * t.element_size(), dtype=torch.uint8)
                            for name, t in self.cache.stacked_tensors().items()}
        return self.scratch

    def staged_read(self, event: torch.cuda.Event) -> None:
        """A side stream's copy out of the latest gather ends at `event`: its buffer waits for it."""
        self._reads[self._turn].append(event)


def chunks(items: list, size: int) -> list[list]:
    return [items[start:start + size] for start in range(0, len(items), size)]
