"""GPU decode attention over the paged KV cache: the CUDA kernel of `mlxcel::paged_decode_attention`.

Issue 11: on the H200 the tensor-op attention of a decode step was eight kernels a layer (gather
keys, gather values, masked scores, a softmax in three passes, the weighted sum), about 19 us a
layer at batch 1, 40 % of the step. These two Triton kernels read each row's keys straight from
their cache slots in fixed chunks of keys (flash-decoding: a chunk's partial softmax, then an
exact merge of the chunks in order), so a layer's attention is two launches.

Imported only where CUDA and Triton are (paged_attention.supports registers it as the op's CUDA
kernel); the CPU build never sees it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 128  # keys a program reads: a row's chunks are key indices, whatever the batch
BLOCK = 64  # keys a loop iteration loads (a multiple of every KEY_ALIGN bucket)
MIN_GROUP = 16  # tl.dot's smallest row count: a GQA group's query heads are padded to it


@triton.jit
def _chunk_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, qpos_ptr, m_ptr, l_ptr, acc_ptr,
                  num_keys, num_chunks, q_heads, kv_heads, dim, scale, window,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
                  CHUNK_KEYS: tl.constexpr, BLOCK_KEYS: tl.constexpr):
    row, kv_head, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    head_ok = tl.arange(0, GROUP_PAD) < GROUP
    d = tl.arange(0, DIM_PAD)
    d_ok = d < dim
    q = tl.load(q_ptr + (row * q_heads + heads)[:, None] * dim + d[None, :],
                mask=head_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = tl.load(qpos_ptr + row)
    m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    total = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, DIM_PAD), tl.float32)
    for start in range(chunk * CHUNK_KEYS, chunk * CHUNK_KEYS + CHUNK_KEYS, BLOCK_KEYS):
        j = start + tl.arange(0, BLOCK_KEYS)
        in_row = j < num_keys
        slot = tl.load(slots_ptr + row * num_keys + j, mask=in_row, other=0)
        pos = tl.load(pos_ptr + row * num_keys + j, mask=in_row, other=-1)
        visible = (pos >= 0) & ((window == 0) | (pos > q_pos - window))
        offsets = (slot * kv_heads + kv_head)[:, None] * dim + d[None, :]
        kv_mask = visible[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + offsets, mask=kv_mask, other=0.0)
        scores = tl.dot(q.to(k.dtype), tl.trans(k), input_precision="ieee") * scale
        scores = tl.where(visible[None, :], scores, float("-inf"))
        new_m = tl.maximum(m, tl.max(scores, axis=1))
        safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)  # no visible key yet: every weight 0
        p = tl.exp(scores - safe_m[:, None])
        alpha = tl.exp(m - safe_m)
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = new_m
    part = (row * q_heads + heads) * num_chunks + chunk
    tl.store(m_ptr + part, m, mask=head_ok)
    tl.store(l_ptr + part, total, mask=head_ok)
    tl.store(acc_ptr + part[:, None] * dim + d[None, :], acc, mask=head_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, num_chunks, dim,
                  CHUNKS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    head = tl.program_id(0)  # row * q_heads + query head
    c = tl.arange(0, CHUNKS_PAD)
    c_ok = c < num_chunks
    d = tl.arange(0, DIM_PAD)
    d_ok = d < dim
    m = tl.load(m_ptr + head * num_chunks + c, mask=c_ok, other=float("-inf"))
    top = tl.max(m, axis=0)
    weight = tl.exp(m - tl.where(top == float("-inf"), 0.0, top))
    total = tl.sum(tl.load(l_ptr + head * num_chunks + c, mask=c_ok, other=0.0) * weight, axis=0)
    acc = tl.load(acc_ptr + (head * num_chunks + c)[:, None] * dim + d[None, :],
                  mask=c_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)  # a padding row: 0
    tl.store(out_ptr + head * dim + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def paged_decode_attention_cuda(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                key_slots: torch.Tensor, key_pos: torch.Tensor, q_pos: torch.Tensor, scale: float,
                                window: int) -> torch.Tensor:
    """The op's CUDA kernel (paged_attention.py registers it): the same contract as the CPU one."""
    rows, q_heads, dim = q.shape
    kv_heads, num_keys = k_cache.shape[1], key_slots.shape[1]
    group = q_heads // kv_heads
    num_chunks = max(triton.cdiv(num_keys, CHUNK), 1)
    q = q.contiguous()
    m = torch.empty(rows, q_heads, num_chunks, dtype=torch.float32, device=q.device)
    total = torch.empty_like(m)
    acc = torch.empty(rows, q_heads, num_chunks, dim, dtype=torch.float32, device=q.device)
    dim_pad = max(triton.next_power_of_2(dim), 16)  # tl.dot takes no side under 16
    _chunk_kernel[(rows, kv_heads, num_chunks)](
        q, k_cache, v_cache, key_slots, key_pos, q_pos, m, total, acc, num_keys, num_chunks, q_heads, kv_heads, dim,
        float(scale), int(window), GROUP=group, GROUP_PAD=max(triton.next_power_of_2(group), MIN_GROUP),
        DIM_PAD=dim_pad, CHUNK_KEYS=CHUNK, BLOCK_KEYS=BLOCK)
    out = torch.empty_like(q)
    _merge_kernel[(rows * q_heads,)](m, total, acc, out, num_chunks, dim,
                                     CHUNKS_PAD=triton.next_power_of_2(num_chunks), DIM_PAD=dim_pad)
    return out
