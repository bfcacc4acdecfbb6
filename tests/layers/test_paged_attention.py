"""Issue 11 (points 2 and 4): the CPU paged decode-attention kernel against the tensor-op
reference, its bit-identity alone and in any batch, and its refusals of inputs it cannot read."""

from __future__ import annotations

import pytest
import torch

from mlxcel.layers import paged_attention
from mlxcel.layers.attention import decode_attention

pytestmark = pytest.mark.skipif(not paged_attention.available(), reason="no C++ compiler for the kernel")

NUM_SLOTS = 4096
SCRATCH = NUM_SLOTS - 1


def caches(kv_heads: int, dim: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(NUM_SLOTS, kv_heads, dim, generator=g).to(dtype) for _ in range(2))  # type: ignore[return-value]


def rows(lengths: list[int], num_keys: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's live keys in scattered slots (a shuffled pool), padded with the scratch slot."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randperm(SCRATCH, generator=g)
    key_slots = torch.full((len(lengths), num_keys), SCRATCH, dtype=torch.long)
    key_pos = torch.full((len(lengths), num_keys), -1, dtype=torch.long)
    start = 0
    for b, n in enumerate(lengths):
        key_slots[b, :n] = pool[start:start + n]
        key_pos[b, :n] = torch.arange(n)
        start += n
    return key_slots, key_pos, torch.tensor([max(n - 1, 0) for n in lengths])


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_slots: torch.Tensor, key_pos: torch.Tensor,
              q_pos: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    visible = key_pos >= 0
    if window:
        visible &= key_pos > q_pos.unsqueeze(1) - window
    return decode_attention(q, k[key_slots].float(), v[key_slots].float(), visible, scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("q_heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 8), (8, 8, 80), (16, 2, 128)])
def test_kernel_matches_the_tensor_op_attention(dtype: torch.dtype, q_heads: int, kv_heads: int, dim: int) -> None:
    k, v = caches(kv_heads, dim, dtype)
    key_slots, key_pos, q_pos = rows([1, 37, 300, 700], 704)
    q = torch.randn(4, q_heads, dim, generator=torch.Generator().manual_seed(2))
    got = paged_attention.paged_decode_attention(q, k, v, key_slots, key_pos, q_pos, dim ** -0.5, 0)
    want = reference(q, k, v, key_slots, key_pos, q_pos, dim ** -0.5, 0)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_sliding_window_sees_only_the_last_keys() -> None:
    k, v = caches(3, 64, torch.bfloat16)
    key_slots, key_pos, q_pos = rows([50, 600], 640)
    q = torch.randn(2, 9, 64)
    got = paged_attention.paged_decode_attention(q, k, v, key_slots, key_pos, q_pos, 0.125, 128)
    torch.testing.assert_close(got, reference(q, k, v, key_slots, key_pos, q_pos, 0.125, 128), atol=2e-6, rtol=1e-5)


def test_a_row_has_the_same_bits_alone_and_in_any_batch() -> None:
    """Chunk boundaries are key indices of the row and padding adds nothing: no neighbour, key
    padding or thread count changes a row's result (issue 11, point 4)."""
    k, v = caches(3, 64, torch.bfloat16)
    lengths = [5, 250, 257, 1000, 2049]
    key_slots, key_pos, q_pos = rows(lengths, 2112)
    q = torch.randn(len(lengths), 9, 64)
    batched = paged_attention.paged_decode_attention(q, k, v, key_slots, key_pos, q_pos, 0.125, 0)
    threads = torch.get_num_threads()
    try:
        for b, n in enumerate(lengths):
            own = -(-n // 64) * 64
            for num_threads in {1, threads}:
                torch.set_num_threads(num_threads)
                alone = paged_attention.paged_decode_attention(q[b:b + 1], k, v, key_slots[b:b + 1, :own],
                                                               key_pos[b:b + 1, :own], q_pos[b:b + 1], 0.125, 0)
                assert torch.equal(alone[0], batched[b]), (n, num_threads)
    finally:
        torch.set_num_threads(threads)


def test_compiled_call_equals_the_eager_call() -> None:
    k, v = caches(3, 64, torch.bfloat16)
    key_slots, key_pos, q_pos = rows([30, 400], 448)
    q = torch.randn(2, 9, 64)

    def attend(q: torch.Tensor, key_slots: torch.Tensor, key_pos: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        return paged_attention.paged_decode_attention(q * 1.0, k, v, key_slots, key_pos, q_pos, 0.125, 0) + 0.0

    compiled = torch.compile(attend, fullgraph=True, dynamic=True)
    assert torch.equal(compiled(q, key_slots, key_pos, q_pos), attend(q, key_slots, key_pos, q_pos))


def test_a_padding_row_gives_zeros_and_a_slot_outside_the_cache_is_not_read() -> None:
    k, v = caches(3, 64, torch.bfloat16)
    key_slots, key_pos, q_pos = rows([0, 20], 64)
    key_slots[1, 19] = NUM_SLOTS + 10_000_000  # out of range: skipped like a masked key
    q = torch.randn(2, 9, 64)
    got = paged_attention.paged_decode_attention(q, k, v, key_slots, key_pos, q_pos, 0.125, 0)
    assert torch.equal(got[0], torch.zeros(9, 64))
    key_pos[1, 19] = -1
    key_slots[1, 19] = SCRATCH
    torch.testing.assert_close(got[1], reference(q, k, v, key_slots, key_pos, q_pos, 0.125, 0)[1], atol=2e-6,
                               rtol=1e-5)


@pytest.mark.parametrize("bad", ["positions shape", "slot dtype", "query positions", "cache shapes", "cache dtype"])
def test_inconsistent_inputs_raise_instead_of_reading_stray_memory(bad: str) -> None:
    k, v = caches(3, 64, torch.bfloat16)
    key_slots, key_pos, q_pos = rows([10, 20], 64)
    q = torch.randn(2, 9, 64)
    if bad == "positions shape":
        key_pos = key_pos[:, :32].contiguous()
    elif bad == "slot dtype":
        key_slots = key_slots.int()
    elif bad == "query positions":
        q_pos = q_pos[:1]
    elif bad == "cache shapes":
        v = v[:, :2].contiguous()
    elif bad == "cache dtype":
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="paged attention"):
        paged_attention.paged_decode_attention(q, k, v, key_slots, key_pos, q_pos, 0.125, 0)
