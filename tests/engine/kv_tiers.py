"""What the KV tier tests (disk, host) do to a small CPU pool: admit a prompt as a forward pass would, read blocks back."""

from __future__ import annotations

import torch

from mlxcel.engine.kv.prefix import KVCacheManager
from mlxcel.engine.kv.tensors import KVCache


def compute(kv: KVCacheManager, cache: KVCache, request_id: str, tokens: list[int]) -> list[int]:
    """Admit a prompt, write random KV for what is not cached (as a forward pass would) and finish it; its blocks."""
    cached, num_cached = kv.find_cached_prefix(tokens, cache_prompt=True)
    kv.allocate(request_id, tokens, num_cached, len(tokens) - num_cached, cached)
    kv.pool.flush_evictions()  # as the engine loop does before a step: the tiers gather what was evicted
    table = kv.block_table(request_id)
    slots = torch.tensor(kv.slot_mapping(request_id, num_cached, len(tokens)))
    for layer, (heads, dim) in enumerate(cache.layer_shapes):
        cache.write(layer, slots, torch.randn(len(slots), heads, dim), torch.randn(len(slots), heads, dim))
    kv.free(request_id)
    return table


def block_rows(cache: KVCache, block_ids: list[int]) -> list[torch.Tensor]:
    """Copies of every cache tensor's rows of `block_ids`, to compare after a round trip."""
    size = cache.block_size
    slots = torch.tensor([b * size + i for b in block_ids for i in range(size)])
    return [t[slots].clone() for tensors in cache.named_tensors().values() for t in tensors]
