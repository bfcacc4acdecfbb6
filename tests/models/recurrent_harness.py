"""A hybrid (recurrent + attention) family run the ways the engine runs it, with its recurrent states
carried explicitly: harness.py's paged KV cache for its attention layers plus a `StateTensors`
pool (layers/recurrent.py) with one slot a sequence for its recurrent layers. Pass
`sequences=HybridSequences` to harness.py's `cached_logits`, `lockstep_cached_logits` and `greedy`."""

from __future__ import annotations

from torch import nn

from mlxcel.layers.attention import AttentionContext, SequenceSlice
from mlxcel.layers.recurrent import RecurrentStates, StateTensors, state_specs

from .harness import PagedSequences


class HybridSequences(PagedSequences):
    """PagedSequences whose steps also read and write each sequence's recurrent state slot."""

    def __init__(self, model: nn.Module, num_blocks: int = 96, block_size: int = 4, num_slots: int = 8) -> None:
        super().__init__(model, num_blocks, block_size)
        param = next(model.parameters())
        self.pool = StateTensors(state_specs(model), num_slots, param.dtype, param.device)
        self.slots: dict[int, int] = {}

    def _context(self, seq_ids: list[int], slices: list[SequenceSlice]) -> AttentionContext:
        for seq_id in seq_ids:
            if seq_id not in self.slots:  # slot 0 is the scratch slot
                self.slots[seq_id] = len(self.slots) + 1
                self.pool.clear([self.slots[seq_id]])
        slots = [self.slots[seq_id] for seq_id in seq_ids]
        states = RecurrentStates(self.pool, [s.q_start for s in slices], [s.q_len for s in slices], slots, slots)
        return AttentionContext(slices, self.kv, self.device, states=states)
