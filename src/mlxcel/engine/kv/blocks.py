"""Paged KV block pool: ref-counted blocks, an LRU free queue and the hash index of cached blocks.

Pure bookkeeping, no tensors: the KV tensors (tensors.py) are indexed by block id
(spec A3). A block whose ref count drops to 0 keeps its hash and stays reusable by the
prefix cache until `allocate` takes it from the head of the free queue (the eviction).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Called with the (block_id, block_hash) pairs an allocation evicts, before their KV is overwritten.
EvictionHook = Callable[[list[tuple[int, int]]], None]


class NoFreeBlocksError(RuntimeError):
    """The pool holds fewer free blocks than an allocation asked for."""

    def __init__(self, num_requested: int, num_free: int) -> None:
        super().__init__(f"asked for {num_requested} KV blocks but only {num_free} are free")
        self.num_requested = num_requested
        self.num_free = num_free


@dataclass(slots=True)
class Block:
    """One KV block. `block_hash` is set only while the block is in the pool's hash index."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


class BlockPool:
    """A fixed set of KV blocks handed out by id, with ref counts and a prefix-hash index.

    Free blocks (ref count 0, cached or not) wait in one queue in eviction order: `allocate`
    takes from the head, `free` appends to the tail. Invariant: `block.block_hash` is not
    None exactly when the index maps that hash to that block.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least 1 block, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1 token, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        # OrderedDict as the free queue: O(1) pop from the head, append and remove from the middle.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self._num_free_cached = 0
        self.num_evictions = 0
        self.on_evict: EvictionHook | None = None  # the disk tier's writer (issue 29); None = evictions vanish
        self.on_flush: Callable[[], None] | None = None  # gathers what on_evict noted (engine/kv/evict.py)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, whether or not they still hold a cached prefix."""
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix (evicted first-in, first-out)."""
        return self._num_free_cached

    @property
    def num_hashed_blocks(self) -> int:
        """All blocks in the hash index, in use or free."""
        return len(self._hash_to_block)

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be allocated) first; for tests and debugging."""
        return list(self._free_queue)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks from the head of the free queue, each with ref count 1.

        A taken block that still held a cached prefix loses it (counted in `num_evictions`).
        Raises NoFreeBlocksError, changing nothing, when fewer blocks are free.
        """
        if num_blocks < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({num_blocks})")
        if num_blocks > len(self._free_queue):
            raise NoFreeBlocksError(num_blocks, len(self._free_queue))
        evicted: list[tuple[int, int]] = []
        block_ids = [self._pop_free_block(evicted) for _ in range(num_blocks)]
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return block_ids

    def flush_evictions(self) -> None:
        """Call before writing KV into blocks this pool handed out: the eviction hook's tier gathers the
        evicted blocks' old KV first (one batch for all evictions since the last flush)."""
        if self.on_flush is not None:
            self.on_flush()

    def _pop_free_block(self, evicted: list[tuple[int, int]]) -> int:
        block_id, _ = self._free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            evicted.append((block_id, block.block_hash))
            self._num_free_cached -= 1
            self._drop_hash(block)
            self.num_evictions += 1
        block.ref_count = 1
        return block_id

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free-queue tail in
        the order given. Callers pass a sequence's blocks in reverse so its last blocks are
        evicted first and its shared head stays longest."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise ValueError(f"KV block {block_id} is already free (double free)")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_queue[block_id] = None
                self._num_free_cached += block.block_hash is not None

    def touch(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block (prefix-cache hits); a free block leaves the queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free_queue[block_id]
                self._num_free_cached -= block.block_hash is not None
            block.ref_count += 1

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Register a FULL block in use under its chain hash; True if it was registered.

        First writer wins: when another block already holds the hash, this one stays
        unhashed (its content is the same, so nothing is lost). No-op with caching off.
        """
        if not self.enable_caching:
            return False
        block = self.blocks[block_id]
        if block.ref_count == 0:
            raise ValueError(f"KV block {block_id} is free; only a block in use can be cached")
        if block.block_hash is not None:
            if block.block_hash == block_hash:
                return False
            raise ValueError(f"KV block {block_id} already holds a different prefix hash")
        if block_hash in self._hash_to_block:
            return False
        self._hash_to_block[block_hash] = block_id
        block.block_hash = block_hash
        return True

    def uncache_block(self, block_id: int) -> bool:
        """Remove a block from the hash index (its KV is not valid); True if it was there."""
        block = self.blocks[block_id]
        if block.block_hash is None:
            return False
        if block.ref_count == 0:
            self._num_free_cached -= 1
        self._drop_hash(block)
        return True

    def cached_blocks(self) -> list[tuple[int, int]]:
        """Every (block_id, block_hash) in the hash index, most recently used first: the blocks in use,
        then the free ones from the free queue's tail (the disk tier's shutdown save)."""
        in_use = [(b.block_id, b.block_hash) for b in self.blocks if b.block_hash is not None and b.ref_count > 0]
        free = [(i, self.blocks[i].block_hash) for i in reversed(self._free_queue)]
        return in_use + [(i, h) for i, h in free if h is not None]

    def lookup(self, block_hash: int) -> int | None:
        """The block holding this chain hash, in use or free, or None."""
        return self._hash_to_block.get(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash, as vLLM does: only when no block is in use.

        Returns False and changes nothing while any block is in use. The server calls
        `clear_free_cached_blocks` instead (through KVCacheManager.reset), which works under load.
        """
        if self.num_used_blocks > 0:
            return False
        for block_id in self._hash_to_block.values():
            self.blocks[block_id].block_hash = None
        self._hash_to_block.clear()
        self._num_free_cached = 0
        return True

    def clear_free_cached_blocks(self) -> int:
        """Drop the hashes of free blocks only; blocks in use keep theirs. Returns how many.

        Not counted as evictions: nothing was displaced by an allocation.
        """
        blocks = (self.blocks[block_id] for block_id in self._hash_to_block.values())
        cleared = [block for block in blocks if block.ref_count == 0]
        for block in cleared:
            self._drop_hash(block)
        self._num_free_cached = 0
        return len(cleared)

    def _drop_hash(self, block: Block) -> None:
        assert block.block_hash is not None
        del self._hash_to_block[block.block_hash]
        block.block_hash = None
