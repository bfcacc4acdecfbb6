"""Issue 11 (points 3 and 6): the Triton kernel of `mlxcel::paged_decode_attention` on CUDA against
the tensor-op reference, inside a CUDA graph too. Runs where CUDA and Triton are (the lent GPU:
`PYTHONPATH=src python3 -m pytest tests/layers/test_paged_attention_cuda.py`); skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from mlxcel.layers import paged_attention
from tests.layers.test_paged_attention import reference, rows

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and paged_attention.supports(torch.bfloat16, torch.device("cuda"))),
    reason="needs CUDA and Triton")

NUM_SLOTS = 4096


def cuda_caches(kv_heads: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(NUM_SLOTS, kv_heads, dim, generator=g).to(dtype).cuda() for _ in range(2))  # type: ignore[return-value]


def on_cuda(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.cuda() for t in tensors]


TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (3e-3, 3e-3)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("q_heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 8), (8, 8, 80), (12, 2, 128)])
def test_triton_kernel_matches_the_tensor_op_attention(dtype: torch.dtype, q_heads: int, kv_heads: int,
                                                       dim: int) -> None:
    k, v = cuda_caches(kv_heads, dim, dtype)
    key_slots, key_pos, q_pos = on_cuda(*rows([1, 37, 300, 700, 0], 768))
    q = torch.randn(5, q_heads, dim, generator=torch.Generator().manual_seed(2)).to(dtype).cuda()
    got = paged_attention.paged_decode_attention(q, k, v, key_slots, key_pos, q_pos, dim ** -0.5, 0)
    want = reference(q.float(), k, v, key_slots, key_pos, q_pos, dim ** -0.5, 0)
    assert got.dtype == dtype and got.shape == q.shape
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got[:4].float(), want[:4], atol=atol, rtol=rtol)
    assert torch.equal(got[4], torch.zeros_like(got[4]))  # a padding row (no key): zeros, not NaN


def test_triton_sliding_window_sees_only_the_last_keys() -> None:
    k, v = cuda_caches(3, 64, torch.float32)
    key_slots, key_pos, q_pos = on_cuda(*rows([50, 600], 640))
    q = torch.randn(2, 9, 64).cuda()
    got = paged_attention.paged_decode_attention(q, k, v, key_slots, key_pos, q_pos, 0.125, 128)
    torch.testing.assert_close(got, reference(q, k, v, key_slots, key_pos, q_pos, 0.125, 128), atol=1e-5, rtol=1e-5)


def test_triton_kernel_replays_in_a_cuda_graph() -> None:
    k, v = cuda_caches(3, 64, torch.bfloat16)
    key_slots, key_pos, q_pos = on_cuda(*rows([100, 200], 256))
    q = torch.randn(2, 9, 64).to(torch.bfloat16).cuda()
    paged_attention.paged_decode_attention(q, k, v, key_slots, key_pos, q_pos, 0.125, 0)  # compiled outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention.paged_decode_attention(q, k, v, key_slots, key_pos, q_pos, 0.125, 0)
    new_slots, new_pos, new_q_pos = on_cuda(*rows([30, 250], 256, seed=5))
    key_slots.copy_(new_slots), key_pos.copy_(new_pos), q_pos.copy_(new_q_pos)
    graph.replay()
    want = paged_attention.paged_decode_attention(q, k, v, key_slots, key_pos, q_pos, 0.125, 0)
    assert torch.equal(out, want)
