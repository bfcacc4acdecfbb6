"""A decoder-only model's last-position logits without a KV cache: the generative reranker's
model call (spec I).

The reranker's worker thread owns its copy of the model, so this runs only there (DESIGN
rule 4); the forward is the families' own, over one flat batch with no cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mlxcel.layers.attention import AttentionContext, SequenceSlice


def last_position_logits(
    model: torch.nn.Module, token_lists: Sequence[Sequence[int]], device: torch.device | str
) -> torch.Tensor:
    """Logits at each list's last token, [batch, vocab] float32 on CPU; one uncached forward."""
    if not token_lists or any(len(tokens) == 0 for tokens in token_lists):
        raise ValueError("every prompt needs at least one token")
    ids: list[int] = []
    positions: list[int] = []
    slices: list[SequenceSlice] = []
    for tokens in token_lists:
        slices.append(SequenceSlice(q_start=len(ids), q_len=len(tokens), kv_len=len(tokens)))
        ids.extend(tokens)
        positions.extend(range(len(tokens)))
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    with torch.inference_mode():
        hidden = model(as_tensor(ids), as_tensor(positions), AttentionContext(slices, None, device))  # [T, hidden]
        last = as_tensor([s.q_start + s.q_len - 1 for s in slices])
        return model.compute_logits(hidden.index_select(0, last)).float().cpu()
