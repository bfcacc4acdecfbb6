"""The base of the recurrent mixers built here (Mamba-2, LFM2's short conv, the RG-LRU) over
layers/recurrent.py's state interface.

A mixer projects every row of the step at once (`linear` over the flat batch), then advances its
recurrence over the step's sequences as one padded batch [S, L, ...] with its states explicit:
`scan(u, conv, recurrent, valid) -> (y, conv, recurrent)`, the chunked form for a prompt chunk
(SSD's chunked scan, a conv over the whole chunk) and, for L == 1, the one-token form. Padded
positions (`valid` False) leave the states unchanged. `recur` reads the states from the context
(`states_of`: a plain forward starts every sequence from zero and keeps nothing) and writes them back;
speculative verify rows (`token_slots`) go one position at a time so the state after every row is kept.
"""

from __future__ import annotations

import torch
from torch import nn

from mlxcel.layers.recurrent import RecurrentStates, StateSpec, states_of


class RecurrentMixer(nn.Module):
    layer_idx: int
    state_spec: StateSpec

    def scan(self, u: torch.Tensor, conv: torch.Tensor | None, recurrent: torch.Tensor | None,
             valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """u [S, L, ...] -> (y [S, L, ...], conv and recurrent states after each sequence's last
        valid position); None states in: zeros."""
        raise NotImplementedError

    def recur(self, u: torch.Tensor, ctx: object) -> torch.Tensor:
        """u [T, ...] (the step's rows, flat) -> y [T, ...] through each sequence's recurrence."""
        states = states_of(ctx, u)
        conv, rec = states.read(self.layer_idx)
        if states.is_decode:
            y, conv, rec = self.scan(u.unsqueeze(1), conv, rec, None)
            states.write(self.layer_idx, conv, rec)
            return y.squeeze(1)
        batch = states.to_batch(u)
        if states.token_slots is not None:
            return self._recur_verify(batch, conv, rec, states)
        y, conv, rec = self.scan(batch, conv, rec, states.valid)
        states.write(self.layer_idx, conv, rec)
        return states.from_batch(y)

    def _recur_verify(self, batch: torch.Tensor, conv: torch.Tensor | None, rec: torch.Tensor | None,
                      states: RecurrentStates) -> torch.Tensor:
        """Draft rows to verify (a few a sequence): one position at a time, keeping every row's state."""
        outputs, convs, recs = [], [], []
        for t in range(batch.shape[1]):
            y, conv, rec = self.scan(batch[:, t:t + 1], conv, rec, states.valid[:, t:t + 1])
            outputs.append(y)
            convs.append(conv)
            recs.append(rec)
        stacked = [None if parts[0] is None else states.from_batch(torch.stack(parts, dim=1)) for parts in (convs, recs)]
        states.write_tokens(self.layer_idx, *stacked)
        states.write(self.layer_idx, conv, rec)
        return states.from_batch(torch.cat(outputs, dim=1))
