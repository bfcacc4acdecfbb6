"""Attention pieces the dynamic-resolution vision towers share (Qwen-VL, Pixtral): the 2-D (axial)
rotary over patch rows and columns, and bidirectional attention within segments of a packed patch
sequence (each image, frame or window attends only to itself)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def axial_rope(positions: torch.Tensor, row_freqs: torch.Tensor, col_freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [N, 1, head_dim] (for `rope.apply_rope`) of patches at `positions` [N, 2]
    (row, column): the first half of the angles turn with the row at `row_freqs`, the second with
    the column at `col_freqs` (head_dim / 4 each), in float32, halves repeated as HF's rotate-half wants."""
    pos = positions.to(device=row_freqs.device, dtype=torch.float32)
    angles = torch.cat((pos[:, :1] * row_freqs, pos[:, 1:] * col_freqs), dim=-1)  # [N, head_dim / 2]
    emb = torch.cat((angles, angles), dim=-1)
    sin, half = emb.sin(), angles.shape[-1]
    return emb.cos().unsqueeze(1), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).unsqueeze(1)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: tuple[int, ...],
                      scale: float) -> torch.Tensor:
    """Bidirectional attention of each segment [bounds[i], bounds[i+1]) over itself only.

    q, k, v: [N, heads, head_dim] -> [N, heads, head_dim]. Segments of one length go through SDPA
    as one batch (an image's windows are mostly equal)."""
    out = torch.empty_like(q)
    starts = torch.tensor(bounds[:-1])
    lengths = torch.tensor(bounds[1:]) - starts
    for length in lengths.unique().tolist():
        rows = (starts[lengths == length, None] + torch.arange(length)).to(q.device)  # [segments, length]
        # [segments, length, heads, head_dim] -> [segments, heads, length, head_dim]
        qs, ks, vs = (x[rows].transpose(1, 2) for x in (q, k, v))
        out[rows] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(1, 2)
    return out
