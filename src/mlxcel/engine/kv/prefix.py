"""Automatic prefix caching over the block pool: chain hashes of full blocks, per-request
block tables and the donation of computed blocks to the cache (spec A3, M, N).

Token position p of a request lives in block `block_table(rid)[p // block_size]` at offset
`p % block_size`, i.e. KV slot `block_id * block_size + p % block_size` (`slot_mapping`).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from mlxcel.engine.kv.blocks import BlockPool
from mlxcel.types import ImageCacheKeys, PrefixCacheStats

# Marks a block released by free_prefix (spec N); table indices stay equal to positions.
RELEASED_BLOCK = -1

# The parent of a prompt's first block, so no real block hashes from a bare "no parent".
_ROOT_HASH = int.from_bytes(hashlib.sha256(b"mlxcel.prefix_cache.root").digest(), "big")


def hash_block_tokens(
    parent_hash: int | None, token_ids: Sequence[int], extra: object = None
) -> int:
    """The chain hash of one block: sha256(parent hash, token count, token ids, repr(extra)).

    sha256, not Python's `hash(tuple)`: the tuple hash is 64-bit and not collision resistant,
    so a crafted prompt could collide with another user's cached prefix and be served that
    user's KV (vLLM's CVE-2025-25183). It costs about a microsecond a block and is stable
    across processes, so slot snapshots may store it. `extra` (a LoRA id, a cache salt)
    must have a stable repr: int, str, or tuples of those.
    """
    parent = _ROOT_HASH if parent_hash is None else parent_hash
    digest = hashlib.sha256(parent.to_bytes(32, "big"))
    digest.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    if extra is not None:
        digest.update(repr(extra).encode())
    return int.from_bytes(digest.digest(), "big")


def hash_prompt_blocks(
    token_ids: Sequence[int], block_size: int, extra: object = None
) -> list[int]:
    """Chain hashes of the full blocks of `token_ids`; a partial last block has none."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size],
                                        block_extra(extra, start // block_size, block_size)))
    return hashes


def block_extra(extra: object, index: int, block_size: int) -> object:
    """The `extra` of block `index`: a per-block key (`ImageCacheKeys`, issue 43) gives its own; any
    other extra is the same for every block."""
    if isinstance(extra, ImageCacheKeys):
        return extra.for_block(index * block_size, (index + 1) * block_size)
    return extra


class LowerTier(Protocol):
    """A slower store under the RAM prefix cache (the disk tier, issue 29): asked on a RAM miss."""

    def load(self, pool: BlockPool, block_hashes: list[int], hit_blocks: list[int], num_rest_tokens: int) -> list[int]:
        """Bring the longest stored run of `block_hashes` (consecutive chain hashes) into free, cached
        blocks of `pool`, keeping `hit_blocks` (the RAM hits before them) cached; the loaded block ids."""
        ...


@dataclass(slots=True)
class _RequestBlocks:
    block_ids: list[int]  # the block table; RELEASED_BLOCK where free_prefix released one
    block_hashes: list[int]  # chain hashes of blocks [0, len): the donation cursor
    num_hit_blocks: int  # head blocks that came from the cache at admission
    is_donating: bool  # caching on, cache_prompt, and no window start yet (spec N)
    extra: object


class KVCacheManager:
    """Per-request block tables over a BlockPool, with automatic prefix caching.

    Call order per request: `find_cached_prefix` then at once the first `allocate` with its
    blocks (no allocation for another request in between, or the hits may be evicted);
    `allocate` every step after; `free` when it finishes, aborts or is preempted.
    """

    def __init__(self, pool: BlockPool, *, enable_prefix_caching: bool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.is_enabled = enable_prefix_caching and pool.enable_caching
        self._requests: dict[str, _RequestBlocks] = {}
        self._num_hits = 0
        self._num_misses = 0
        self._num_reused_tokens = 0
        self.lower_tier: LowerTier | None = None  # consulted on a RAM miss; None = RAM only

    def find_cached_prefix(
        self, token_ids: Sequence[int], *, cache_prompt: bool, extra: object = None,
        include_last_block: bool = False,
    ) -> tuple[list[int], int]:
        """The cached blocks of the longest cached prefix of `token_ids`, and its token count.

        Never the whole prompt: at least one token is left to compute so the step produces
        logits. Reads nothing when caching is off or `cache_prompt` is False (spec M). With
        `include_last_block`, a block holding the last token may be hit too; the count is then
        len(token_ids) - 1, and that token's KV is already cached: the caller computes its
        logits without writing its KV (the block may be shared).
        """
        if not (self.is_enabled and cache_prompt):
            return [], 0
        size = self.block_size
        block_ids: list[int] = []
        parent: int | None = None
        num_blocks = len(token_ids) // size if include_last_block else (len(token_ids) - 1) // size
        for index in range(num_blocks):
            parent = hash_block_tokens(parent, token_ids[index * size : (index + 1) * size],
                                       block_extra(extra, index, size))
            block_id = self.pool.lookup(parent)
            if block_id is None:
                if self.lower_tier is not None:
                    block_ids += self._load_lower(token_ids, index, parent, num_blocks, block_ids, extra)
                break
            block_ids.append(block_id)
        return block_ids, min(len(block_ids) * size, max(len(token_ids) - 1, 0))

    def _load_lower(self, token_ids: Sequence[int], index: int, block_hash: int, num_blocks: int,
                    hit_blocks: list[int], extra: object) -> list[int]:
        """Blocks `index`.. from the lower tier: the chain hashes from the first RAM miss on."""
        assert self.lower_tier is not None
        size, hashes = self.block_size, [block_hash]
        for i in range(index + 1, num_blocks):
            hashes.append(hash_block_tokens(hashes[-1], token_ids[i * size : (i + 1) * size],
                                            block_extra(extra, i, size)))
        return self.lower_tier.load(self.pool, hashes, hit_blocks, len(token_ids) - index * size)

    def allocate(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        cached_blocks: list[int] | None = None,
        *,
        cache_prompt: bool = True,
        extra: object = None,
    ) -> list[int] | None:
        """Make room for `num_computed_tokens + num_new_tokens` tokens; the NEW block ids.

        `token_ids` are the request's known tokens (prompt and accepted output); positions
        past them (draft tokens) get room but are not hashed. The first call per request
        takes `cached_blocks` from find_cached_prefix, `cache_prompt` and `extra`; later
        calls ignore the last two. Returns None, changing nothing, when the pool is short.
        Full blocks of known tokens are then hashed and cached (the donation), so the runner
        must write a step's KV before any attention of that step reads it.
        """
        request = self._requests.get(request_id)
        if request is None:
            return self._admit(
                request_id, token_ids, num_computed_tokens + num_new_tokens,
                cached_blocks or [], cache_prompt, extra,
            )
        if cached_blocks:
            raise ValueError(
                f"request {request_id!r} already has blocks; cached_blocks is for its first allocate"
            )
        num_tokens = num_computed_tokens + num_new_tokens
        num_new_blocks = self._num_missing_blocks(len(request.block_ids), num_tokens)
        if num_new_blocks > self.pool.num_free_blocks:
            return None
        new_ids = self.pool.allocate(num_new_blocks)
        request.block_ids.extend(new_ids)
        self._donate(request, token_ids, num_tokens)
        return new_ids

    def _admit(
        self, request_id: str, token_ids: Sequence[int], num_tokens: int,
        cached_blocks: list[int], cache_prompt: bool, extra: object,
    ) -> list[int] | None:
        is_donating = self.is_enabled and cache_prompt
        hashes = self._check_cached_blocks(token_ids, num_tokens, cached_blocks, is_donating, extra)
        num_new_blocks = self._num_missing_blocks(len(cached_blocks), num_tokens)
        # Hits sitting in the free queue stop being allocatable once touched.
        num_free_hits = sum(self.pool.blocks[b].ref_count == 0 for b in cached_blocks)
        if num_new_blocks + num_free_hits > self.pool.num_free_blocks:
            return None
        self.pool.touch(cached_blocks)
        new_ids = self.pool.allocate(num_new_blocks)
        request = _RequestBlocks(
            cached_blocks + new_ids, hashes, len(cached_blocks), is_donating, extra
        )
        self._requests[request_id] = request
        self._record_admission(len(cached_blocks) * self.block_size, is_donating)
        self._donate(request, token_ids, num_tokens)
        return new_ids

    def _check_cached_blocks(
        self, token_ids: Sequence[int], num_tokens: int, cached_blocks: list[int],
        is_donating: bool, extra: object,
    ) -> list[int]:
        """The chain hashes of the hit blocks, after checking they still hold this prefix."""
        if not cached_blocks:
            return []
        if not is_donating:
            raise ValueError("cached_blocks given while prefix caching is off for this request")
        if len(cached_blocks) * self.block_size > min(num_tokens, len(token_ids)):
            raise ValueError(
                f"{len(cached_blocks)} cached blocks hold more tokens than the request's "
                f"{min(num_tokens, len(token_ids))} known tokens to fit"
            )
        num_cached_tokens = len(cached_blocks) * self.block_size
        hashes = hash_prompt_blocks(token_ids[:num_cached_tokens], self.block_size, extra)
        for block_id, block_hash in zip(cached_blocks, hashes):
            if self.pool.blocks[block_id].block_hash != block_hash:
                raise ValueError(
                    f"cached KV block {block_id} no longer holds this prefix; call "
                    "find_cached_prefix right before the request's first allocate"
                )
        return hashes

    def _num_missing_blocks(self, num_table_blocks: int, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - num_table_blocks)

    def _record_admission(self, num_cached_tokens: int, is_reading: bool) -> None:
        if not is_reading:
            return  # caching off or cache_prompt=False: the cache was not consulted
        if num_cached_tokens:
            self._num_hits += 1
            self._num_reused_tokens += num_cached_tokens
        else:
            self._num_misses += 1

    def _donate(self, request: _RequestBlocks, token_ids: Sequence[int], num_tokens: int) -> None:
        """Hash and cache the blocks that are now full of known tokens, from the cursor on."""
        if not request.is_donating:
            return
        size = self.block_size
        hashes = request.block_hashes
        for index in range(len(hashes), min(num_tokens, len(token_ids)) // size):
            parent = hashes[-1] if hashes else None
            block_tokens = token_ids[index * size : (index + 1) * size]
            hashes.append(hash_block_tokens(parent, block_tokens, block_extra(request.extra, index, size)))
            self.pool.cache_block(request.block_ids[index], hashes[-1])

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table; RELEASED_BLOCK (-1) where spec N released one."""
        return list(self._get(request_id).block_ids)

    def slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """KV slot ids (block_id * block_size + offset) of token positions [start, end)."""
        table = self._get(request_id).block_ids
        size = self.block_size
        # Released blocks only ever form a prefix of the table, so checking `start` suffices.
        if start < end and table[start // size] == RELEASED_BLOCK:
            raise ValueError(f"positions [{start}, {end}) of {request_id!r} lie in released blocks")
        return [table[p // size] * size + p % size for p in range(start, end)]

    def free(self, request_id: str, *, num_computed_tokens: int | None = None) -> None:
        """Release the request's blocks in reverse order; a no-op for an unknown request.

        Pass `num_computed_tokens` when the request's last allocation may not have been
        computed (freed in the step that allocated it): blocks it donated past that point
        leave the cache, since their KV was never written.
        """
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if num_computed_tokens is not None:
            self._uncache_uncomputed(request, num_computed_tokens)
        self.pool.free([b for b in reversed(request.block_ids) if b != RELEASED_BLOCK])

    def _uncache_uncomputed(self, request: _RequestBlocks, num_computed_tokens: int) -> None:
        first = max(request.num_hit_blocks, num_computed_tokens // self.block_size)
        for index in range(first, len(request.block_hashes)):
            block_id = request.block_ids[index]
            if block_id == RELEASED_BLOCK:
                continue
            if self.pool.blocks[block_id].block_hash == request.block_hashes[index]:
                self.pool.uncache_block(block_id)

    def free_prefix(self, request_id: str, num_tokens: int) -> int:
        """Release the whole blocks lying before token index `num_tokens` (spec N).

        They become RELEASED_BLOCK in the table so indices stay positions. Any window start
        above 0 also ends the request's donation: tokens computed from now on did not see
        the whole prefix, so their KV must not serve other requests. Call it before the
        step's `allocate`. Returns the number of blocks released.
        """
        request = self._get(request_id)
        if num_tokens > 0:
            request.is_donating = False
        table = request.block_ids
        num_prefix = min(max(num_tokens, 0) // self.block_size, len(table))
        released = [b for b in table[:num_prefix] if b != RELEASED_BLOCK]
        table[:num_prefix] = [RELEASED_BLOCK] * num_prefix
        self.pool.free(released[::-1])
        return len(released)

    def num_cached_tokens(self, request_id: str) -> int:
        """Prompt tokens served from the prefix cache at the request's admission."""
        return self._get(request_id).num_hit_blocks * self.block_size

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free_blocks

    def reset(self) -> bool:
        """Reset the prefix cache (F7): drop the hashes of every free block, even under load.

        Blocks in use keep theirs until freed. False when prefix caching is off (nothing to
        reset). Counters are not reset: they are monotonic for /metrics.
        """
        if not self.is_enabled:
            return False
        self.pool.clear_free_cached_blocks()
        return True

    def stats(self) -> PrefixCacheStats:
        pool = self.pool
        return PrefixCacheStats(
            is_enabled=self.is_enabled,
            num_hits=self._num_hits,
            num_misses=self._num_misses,
            num_reused_tokens=self._num_reused_tokens,
            num_blocks_used=pool.num_used_blocks,
            num_blocks_free=pool.num_free_blocks,
            num_blocks_cached=pool.num_cached_blocks,
            num_evictions=pool.num_evictions,
        )

    def _get(self, request_id: str) -> _RequestBlocks:
        request = self._requests.get(request_id)
        if request is None:
            raise KeyError(f"no KV blocks are allocated for request {request_id!r}")
        return request
