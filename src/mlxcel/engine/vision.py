"""Images in the engine (issue 43): a request's `ImageInput`s become input embeddings at its
placeholder positions.

A prefill chunk that reaches a placeholder position not yet computed (not a prefix-cache hit)
needs its images' embeddings: `encode_pending` runs the model's `encode_images` once for every
such image of the step's chunks (one batch), on the engine thread, and keeps them on the sequence
until it finishes (a preempted sequence recomputes its prompt from them). `embedding_override`
gives the step's rows to overwrite; `bidirectional_spans` the runs that attend both ways (Gemma 3);
`fit_chunk` keeps such a run inside one prefill chunk. The decode step never sees a placeholder:
the runner keeps those positions in prefill chunks (`has_placeholders`).

M-RoPE families (Qwen-VL: the model has `rope_positions`) turn rotary sections by an image's
temporal, row and column positions: `sequence_rope` gives a sequence's prompt positions [3, len]
(computed once from its prompt and images) and the offset every later position takes (index +
offset on all three rows), which `step_positions` and the decode rows use.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch

from mlxcel.layers.attention import SequenceSlice
from mlxcel.layers.decoder import EmbeddingOverride
from mlxcel.types import Request


class Sequence(Protocol):
    """What this module reads of the scheduler's Sequence (it is imported by the scheduler, so not the reverse)."""

    request: Request
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    image_embeds: ImageEmbeddings | None
    rope_positions: RopePositions | None

    @property
    def num_tokens(self) -> int: ...


class ScheduledSeq(Protocol):
    seq: Sequence
    num_new_tokens: int


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


@dataclass(frozen=True, slots=True)
class RopePositions:
    """A sequence's M-RoPE positions: its prompt's [3, num_prompt_tokens], then index + `offset`."""

    prompt: torch.Tensor
    offset: int

    def between(self, start: int, stop: int) -> torch.Tensor:
        """[3, stop - start] positions of indices start..stop-1."""
        inside = self.prompt[:, start:min(stop, self.prompt.shape[1])]
        first = max(start, self.prompt.shape[1])
        after = torch.arange(first, max(stop, first)) + self.offset
        return torch.cat((inside, after.expand(3, -1)), dim=1)


def sequence_rope(model: torch.nn.Module, seq: Sequence) -> RopePositions | None:
    """`seq`'s M-RoPE positions where the model takes them and the request has images (else None:
    the plain positions, the same on every row)."""
    if not seq.request.image_inputs or not hasattr(model, "rope_positions"):
        return None
    if seq.rope_positions is None:
        prompt, offset = model.rope_positions(seq.token_ids[:seq.num_prompt_tokens], seq.request.image_inputs)
        seq.rope_positions = RopePositions(prompt.to(torch.long).cpu(), int(offset))
    return seq.rope_positions


def rope_offset(model: torch.nn.Module, seq: Sequence) -> int:
    """What a position past `seq`'s images adds to its index for the rotary (0 without M-RoPE)."""
    rope = sequence_rope(model, seq)
    return rope.offset if rope is not None else 0


def step_positions(model: torch.nn.Module, spans: Seq[tuple[Sequence, int, int]]) -> list[int] | torch.Tensor:
    """A prefill step's positions: each (sequence, start, stop)'s indices, or, when one of them takes
    M-RoPE positions, [3, T] (the others' rows all the same)."""
    ropes = [sequence_rope(model, seq) for seq, _, _ in spans]
    if all(rope is None for rope in ropes):
        return [p for _, start, stop in spans for p in range(start, stop)]
    return torch.cat([rope.between(start, stop) if rope is not None else torch.arange(start, stop).expand(3, -1)
                      for rope, (_, start, stop) in zip(ropes, spans)], dim=1)
