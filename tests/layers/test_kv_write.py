"""The decode step's KV write on CUDA is one opaque in-place op (layers/attention.py `write_kv`):
traced and compiled, it writes exactly the rows' slots and what the step reads after it sees them."""

from __future__ import annotations

import torch

from mlxcel.layers.attention import write_kv


def test_issue11_write_kv_compiled_writes_in_place_and_is_read_back() -> None:
    def step(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
        write_kv(cache, slots, new)
        return cache[read].float().sum(-1)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    cache = torch.zeros(64, 2, 8, dtype=torch.bfloat16)
    expected = cache.clone()
    slots, new = torch.tensor([3, 17]), torch.randn(2, 2, 8)
    read = torch.tensor([[3, 0], [17, 5]])
    out = compiled(cache, slots, new, read)
    expected.index_copy_(0, slots, new.to(torch.bfloat16))
    assert torch.equal(cache, expected)  # in place, the cache's dtype, no other slot touched
    assert torch.equal(out, step(expected.clone(), slots, new, read))


def _resident_mib() -> float:
    import os

    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_issue11_a_cpu_pool_is_resident_only_where_blocks_were_written() -> None:
    """Peak RSS (issue 11 point 5): the CPU pool's pages are zeroed by the OS on first touch."""
    import sys

    import pytest

    from mlxcel.engine.kv.tensors import KVCache

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/statm")
    before = _resident_mib()
    cache = KVCache(30, 2048, 16, 3, 64, torch.bfloat16, "cpu")  # 720 MiB of K and V
    pool_mib = cache.bytes_per_token * 2048 * 16 / 2**20
    cache.write(3, torch.arange(64), torch.ones(64, 3, 64), torch.ones(64, 3, 64))
    grown = _resident_mib() - before
    assert pool_mib > 700 and grown < 64, f"{grown:.0f} MiB resident of a {pool_mib:.0f} MiB pool"
    assert torch.equal(cache.k[3][63], torch.ones(3, 64, dtype=torch.bfloat16))
    assert not cache.k[4].any()  # untouched layers read as zeros
