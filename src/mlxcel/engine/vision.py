"""Images in the engine (issue 43): a request's `ImageInput`s become input embeddings at its
placeholder positions.

A prefill chunk that reaches a placeholder position not yet computed (not a prefix-cache hit)
needs its images' embeddings: `encode_pending` runs the model's `encode_images` once for every
such image of the step's chunks (one batch), on the engine thread, and keeps them on the sequence
until it finishes (a preempted sequence recomputes its prompt from them). `embedding_override`
gives the step's rows to overwrite; `bidirectional_spans` the runs that attend both ways (Gemma 3);
`fit_chunk` keeps such a run inside one prefill chunk. The decode step never sees a placeholder:
the runner keeps those positions in prefill chunks (`has_placeholders`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mlxcel.layers.decoder import EmbeddingOverride

if TYPE_CHECKING:
    from mlxcel.engine.scheduler import ScheduledSeq, Sequence
    from mlxcel.layers.attention import SequenceSlice


@dataclass(frozen=True, slots=True)
class ImageEmbeddings:
    """A sequence's image embeddings: `positions` (sorted) and their rows `values` [n, hidden]."""

    positions: list[int]
    values: torch.Tensor

    def rows_in(self, start: int, stop: int) -> tuple[int, int]:
        """The index range of `positions` inside [start, stop)."""
        return bisect.bisect_left(self.positions, start), bisect.bisect_left(self.positions, stop)


def placeholder_positions(seq: Sequence) -> list[int]:
    return sorted(p for image in seq.request.image_inputs for p in image.positions())


def has_placeholders(seq: Sequence, start: int, stop: int) -> bool:
    """Whether any of positions [start, stop) of `seq` is an image placeholder."""
    return any(a < stop and a + n > start for image in seq.request.image_inputs for a, n in image.runs)


def encode_pending(model: torch.nn.Module, scheduled: Seq[ScheduledSeq]) -> None:
    """Encode, in one batch, the images of every chunk that reaches a placeholder still to compute."""
    pending = [item.seq for item in scheduled
               if item.seq.request.image_inputs and item.seq.image_embeds is None
               and has_placeholders(item.seq, item.seq.num_computed_tokens, item.seq.num_tokens)]
    if not pending:
        return
    images = [image for seq in pending for image in seq.request.image_inputs]
    outputs = iter(model.encode_images(images))
    for seq in pending:
        values = [next(outputs) for _ in seq.request.image_inputs]
        # Placeholder positions in prompt order; images and their runs are in prompt order too.
        seq.image_embeds = ImageEmbeddings(placeholder_positions(seq), torch.cat(values))


def embedding_override(scheduled: Seq[ScheduledSeq], slices: Seq[SequenceSlice],
                       device: torch.device) -> EmbeddingOverride | None:
    """The rows of the step's flat token batch that take image embeddings; None when none do."""
    rows: list[int] = []
    values: list[torch.Tensor] = []
    for item, sl in zip(scheduled, slices):
        embeds = item.seq.image_embeds
        if embeds is None:
            continue
        start = item.seq.num_computed_tokens
        lo, hi = embeds.rows_in(start, start + item.num_new_tokens)
        rows += [sl.q_start + p - start for p in embeds.positions[lo:hi]]
        values.append(embeds.values[lo:hi])
    if not rows:
        return None
    return EmbeddingOverride(torch.tensor(rows, dtype=torch.long, device=device), torch.cat(values).to(device))


def bidirectional_spans(seq: Sequence) -> tuple[tuple[int, int], ...]:
    return tuple((a, a + n) for image in seq.request.image_inputs if image.is_bidirectional for a, n in image.runs)


def fit_chunk(seq: Sequence, start: int, num_new: int) -> int:
    """`num_new`, or fewer so that the chunk from position `start` does not end inside a bidirectional
    run that it starts before (the run then comes whole in a later chunk)."""
    stop = start + num_new
    for a, end in bidirectional_spans(seq):
        if start < a < stop < end:
            return a - start
    return num_new
