"""The GPU's prefill attention (one padded call for every chunk of a step, issue 25) equals the
CPU's block-aligned calls, on a real KVCache with cached prefixes, freed blocks and a window."""

from __future__ import annotations

import pytest
import torch

from mlxcel.engine.kv.tensors import KVCache
from mlxcel.layers import attention
from mlxcel.layers.attention import AttentionContext, SequenceSlice

HQ, HKV, D, BLOCK = 6, 2, 16, 16


def step(kv: KVCache, seqs: list[SequenceSlice], seed: int, window: int | None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    num = sum(s.q_len for s in seqs)
    q, k, v = (torch.randn(num, h, D, generator=g) for h in (HQ, HKV, HKV))
    return AttentionContext(seqs, kv, "cpu", prefill_only=True).attend(0, q, k, v, scale=D ** -0.5, window=window)


@pytest.mark.parametrize("window", [None, 20])
def test_issue25_one_padded_prefill_call_equals_the_block_aligned_calls(window: int | None,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # a fresh prompt, a chunk after a cached prefix of 37, one whose first block was freed (kv_start 16)
    seqs = [SequenceSlice(0, 23, 23, 0, (0, 1)),
            SequenceSlice(23, 9, 46, 0, (2, 3, 4)),
            SequenceSlice(32, 30, 70, 16, (9, 5, 6, 7, 8))]
    outputs = []
    for grouped in (False, True):
        monkeypatch.setattr(attention, "_groups_prefill", lambda device, grouped=grouped: grouped)
        kv = KVCache(1, 12, BLOCK, HKV, D, torch.float32, "cpu")
        # what earlier steps left in the cache: every position before each chunk
        history = [SequenceSlice(0, s.kv_len - s.q_len, s.kv_len - s.q_len, s.kv_start, s.block_table)
                   for s in seqs[1:]]
        offset = 0
        for h in history:
            step(kv, [SequenceSlice(0, h.q_len, h.kv_len, h.kv_start, h.block_table)], seed=offset + 7, window=window)
            offset += 1
        outputs.append(step(kv, seqs, seed=1, window=window))
    assert torch.allclose(outputs[0], outputs[1], atol=1e-5), (outputs[0] - outputs[1]).abs().max()


@pytest.mark.parametrize("tail", [1, 3, 35])
def test_issue27_a_prompts_rows_get_the_same_bits_in_one_chunk_and_after_a_cached_prefix(tail: int) -> None:
    """Issue 27: float32 rows of a prompt attend to the same bits whether the prompt came in one chunk
    or its last `tail` rows came after a cached prefix (a prefix-cache hit, chunked prefill). Called on
    1-3 query rows, oneDNN's attention summed them in another order than inside a whole block."""
    n, hq, hkv, d = 70, 9, 3, 64
    g = torch.Generator().manual_seed(tail)
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hkv, hkv))
    table = tuple(range(5))
    kv = KVCache(1, 6, BLOCK, hkv, d, torch.bfloat16, "cpu")
    whole = AttentionContext([SequenceSlice(0, n, n, 0, table)], kv, "cpu", prefill_only=True)
    cold = whole.attend(0, q, k, v, scale=d ** -0.5)
    first = n - tail
    AttentionContext([SequenceSlice(0, first, first, 0, table)], kv, "cpu", prefill_only=True).attend(
        0, q[:first], k[:first], v[:first], scale=d ** -0.5)
    hit = AttentionContext([SequenceSlice(0, tail, n, 0, table)], kv, "cpu", prefill_only=True).attend(
        0, q[first:], k[first:], v[first:], scale=d ** -0.5)
    assert torch.equal(hit, cold[first:]), (hit - cold[first:]).abs().max()
