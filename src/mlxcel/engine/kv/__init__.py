"""The KV subsystem: what holds a step's keys and values, and which request owns which of them.

- `blocks.py`: `BlockPool`, fixed-size blocks handed out by id with ref counts, one LRU free
  queue and the hash index of cached blocks (pure Python, no tensors);
- `prefix.py`: `KVCacheManager`, per-request block tables over the pool with automatic prefix
  caching (chain hashes of full blocks, spec A3, M, N);
- `tensors.py`: `KVCache`, the key and value tensors of every layer indexed by cache slot
  (`block_id * block_size + offset`), in the element formats of layers/kv_quant.py;
- `evict.py`: evicted blocks noted by the pool's hook and gathered once per flush (one batch) for the
  host and disk tiers (`host.py`, `disk.py`);
- `slot_files.py`: a slot's cached prefix saved to a file and restored into the prefix cache (F12).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from mlxcel.types import PrefixCacheStats


class PrefixCache(Protocol):
    """What the scheduler, the runner and the engine loop need of the KV bookkeeping: each
    request's block table, grown step by step, and the cached prefix it may start from.
    `prefix.KVCacheManager` is the implementation (its docstrings give the call order)."""

    def find_cached_prefix(self, token_ids: Sequence[int], *, cache_prompt: bool,
                           extra: object = None) -> tuple[list[int], int]:
        """The cached blocks of the longest cached prefix of `token_ids`, and its token count."""
        ...

    def allocate(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int, num_new_tokens: int,
                 cached_blocks: list[int] | None = None, *, cache_prompt: bool = True,
                 extra: object = None) -> list[int] | None:
        """Room for `num_computed_tokens + num_new_tokens` tokens: the new block ids, None when short."""
        ...

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table (block ids by position // block_size)."""
        ...

    def free(self, request_id: str, *, num_computed_tokens: int | None = None) -> None:
        """Release the request's blocks (finished, aborted or preempted)."""
        ...

    def free_prefix(self, request_id: str, num_tokens: int) -> int:
        """Release the whole blocks before token index `num_tokens` (--max-kv-size, spec N)."""
        ...

    def reset(self) -> bool:
        """Drop the hashes of every free block (F7); False when prefix caching is off."""
        ...

    def stats(self) -> PrefixCacheStats: ...
