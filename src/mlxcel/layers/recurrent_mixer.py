"""What the recurrent mixers (Mamba-2, LFM2's short conv, the RG-LRU) share: a step's rows cut per
sequence, each sequence's state read, advanced and written back.

A mixer projects every row of the step at once (`linear` over the flat batch), then runs its
recurrence in one of two forms with its state explicit:
  - `scan_chunk(u, states, positions)`: one sequence's chunk [L, ...] in one go (chunked scan, conv
    over the chunk), from the state before it to the state after it;
  - `scan_step(u, states)`: a batch of single-token rows [B, ...] (decode), states [B, ...].
The states come from the context (`ctx.recurrent`, the engine's state pool, see `RecurrentStates`);
a plain forward (no pool: tests, the reranker) starts every sequence from zeros and keeps nothing.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class RecurrentStates(Protocol):
    """The per-sequence states of one step, as the engine hands them to the layers: rows are the
    step's sequences in `ctx.seqs` order (every row of a decode step)."""

    def read(self, layer: int, rows: list[int]) -> tuple[torch.Tensor, ...]: ...

    def write(self, layer: int, rows: list[int], states: tuple[torch.Tensor, ...]) -> None: ...


class RecurrentMixer(nn.Module):
    """Base of a mixer whose memory is a fixed-size state a sequence (see the module docstring)."""

    layer_idx: int

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shape of each state tensor of one sequence (no batch dimension)."""
        raise NotImplementedError

    def state_dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        """Each state's dtype for activations of `dtype` (a recurrence's state stays float32)."""
        return tuple(dtype for _ in self.state_shapes())

    def zero_states(self, num_rows: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(num_rows, *shape, device=device, dtype=d)
                     for shape, d in zip(self.state_shapes(), self.state_dtypes(dtype)))

    def scan_chunk(self, u: torch.Tensor, states: tuple[torch.Tensor, ...],
                   positions: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        raise NotImplementedError

    def scan_step(self, u: torch.Tensor, states: tuple[torch.Tensor, ...],
                  positions: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        raise NotImplementedError

    def recur(self, u: torch.Tensor, positions: torch.Tensor, ctx: object) -> torch.Tensor:
        """u: [T, ...] the step's rows -> [T, ...]: each sequence's rows through its recurrence."""
        pool: RecurrentStates | None = getattr(ctx, "recurrent", None)
        seqs = getattr(ctx, "seqs", None)
        if seqs is None:  # the decode step: every row a sequence of one token
            rows = list(range(u.shape[0]))
            return self._step_rows(u, positions, rows, pool)
        decode = [i for i, s in enumerate(seqs) if s.q_len == 1 and pool is not None]
        out = torch.empty(u.shape[0], *self.output_shape(u), dtype=u.dtype, device=u.device)
        if decode:
            index = torch.tensor([seqs[i].q_start for i in decode], device=u.device)
            out[index] = self._step_rows(u[index], positions[index], decode, pool)
        chunked = set(decode)
        for i, s in enumerate(seqs):
            if i in chunked:
                continue
            rows = slice(s.q_start, s.q_start + s.q_len)
            states = pool.read(self.layer_idx, [i]) if pool is not None else \
                self.zero_states(1, u.device, u.dtype)
            y, new = self.scan_chunk(u[rows], tuple(t[0] for t in states), positions[rows])
            out[rows] = y
            if pool is not None:
                pool.write(self.layer_idx, [i], tuple(t.unsqueeze(0) for t in new))
        return out

    def output_shape(self, u: torch.Tensor) -> tuple[int, ...]:
        """The shape of one row of the recurrence's output (as one row of its input by default)."""
        return tuple(u.shape[1:])

    def _step_rows(self, u: torch.Tensor, positions: torch.Tensor, rows: list[int],
                   pool: RecurrentStates | None) -> torch.Tensor:
        states = pool.read(self.layer_idx, rows) if pool is not None else \
            self.zero_states(len(rows), u.device, u.dtype)
        y, new = self.scan_step(u, states, positions)
        if pool is not None:
            pool.write(self.layer_idx, rows, new)
        return y
