"""The runner of a hybrid model (issue 41): attention layers over the paged KV cache as `Runner`'s,
recurrent layers over the state pool (engine/kv/states.py).

What differs from `Runner`:
- every row says which state slot it reads and writes (prefill chunks through `RecurrentStates` on the
  attention context, decode rows through `DecodeRow.state_read` / `state_write`);
- a prefill chunk that crosses a block boundary before its end runs in two pieces, so the state at its
  last whole block is snapshotted for the prefix cache (a decode step that ends a block snapshots too);
- no "tail" rows through the decode step: a sequence's positions must run in order, one piece after
  another, as its state carries from each to the next;
- a verify row (a decode row with drafts) runs as one chunk of 1 + k rows through the model's forward,
  keeping the state after each row in the sequence's verify slots; the next step reads the state of the
  last accepted row (`StatePool.read_slot`), so a rejected draft never reaches the state.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mlxcel.engine.decode_step import DecodeRow
from mlxcel.engine.kv.states import StatePool
from mlxcel.engine.runner import Runner, StepLogits
from mlxcel.engine.scheduler import ScheduledSeq, SchedulerOutput, Sequence
from mlxcel.layers.attention import AttentionContext, SequenceSlice
from mlxcel.layers.recurrent import RecurrentStates


class RecurrentRunner(Runner):
    def __init__(self, *args: object, states: StatePool, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.states = states
        self.decode_tails = False
        self.decode_step.states = states.tensors

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepLogits:
        verify = [s for s in out.scheduled if s.is_decode and s.draft]
        rest = SchedulerOutput([s for s in out.scheduled if not (s.is_decode and s.draft)], out.preempted)
        self._pending: list[tuple[Sequence, int, int]] = []  # decode rows' (sequence, slot, position) to note
        step = super().execute(rest) if rest.scheduled else StepLogits([], torch.empty(0, device=self.device), {})
        for seq, slot, position in self._pending:
            self._wrote(seq, slot, position)
        if not verify:
            return step
        return StepLogits(step.request_ids, step.logits, {**step.verify, **self._verify(verify)})

    # ---- prefill ----

    def _run_prefill(self, prefill: list[ScheduledSeq], ids: list[str], parts: list[torch.Tensor]) -> None:
        heads, rests = self._split_at_blocks(prefill)
        super()._run_prefill(heads, ids, parts)
        self._after_pieces(heads)
        if not rests:
            return
        head_lens = [self._head_len(item) for item in rests]
        pieces = [ScheduledSeq(item.seq, item.num_new_tokens - head) for item, head in zip(rests, head_lens)]
        # NOTE: the rest of a split chunk starts where its head ended: the sequence is moved on for the pass
        # (the scheduler moves it on again, by the whole chunk, once the step is over).
        for item, head in zip(rests, head_lens):
            item.seq.num_computed_tokens += head
        try:
            super()._run_prefill(pieces, ids, parts)
            self._after_pieces(pieces)
        finally:
            for item, head in zip(rests, head_lens):
                item.seq.num_computed_tokens -= head

    def _head_len(self, item: ScheduledSeq) -> int:
        """Positions of `item` up to the last block boundary strictly inside it (0: none)."""
        start = item.seq.num_computed_tokens
        boundary = (start + item.num_new_tokens - 1) // self.kv_cache.block_size * self.kv_cache.block_size
        return boundary - start if boundary > start else 0

    def _split_at_blocks(self, chunks: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], list[ScheduledSeq]]:
        heads, rests = [], []
        for item in chunks:
            head = self._head_len(item)
            heads.append(ScheduledSeq(item.seq, head) if head else item)
            if head:
                rests.append(item)
        return heads, rests

    def _prefill_context(self, scheduled: list[ScheduledSeq], slices: list[SequenceSlice]) -> AttentionContext:
        states = RecurrentStates(self.states.tensors, [s.q_start for s in slices], [s.q_len for s in slices],
                                 [self._read_slot(i.seq) for i in scheduled],
                                 [self.states.live_slot(i.seq.slot_id) for i in scheduled])
        return AttentionContext(slices, self.kv_cache, self.device, prefill_only=True, states=states)

    def _after_pieces(self, pieces: list[ScheduledSeq]) -> None:
        """Each piece's sequence now has its state after the piece in its live slot: note it, snapshot it."""
        for item in pieces:
            seq = item.seq
            self._wrote(seq, self.states.live_slot(seq.slot_id), seq.num_computed_tokens + item.num_new_tokens)

    def _wrote(self, seq: Sequence, slot: int, position: int) -> None:
        self.states.wrote(slot, seq.request_id, position)
        if seq.request.cache_prompt and position <= len(seq.token_ids):
            self.states.snapshot(seq.request_id, slot, seq.token_ids, position, seq.request.cache_extra,
                                 is_rolling=position > seq.num_prompt_tokens)

    def _read_slot(self, seq: Sequence) -> int:
        return self.states.read_slot(seq.request_id, seq.slot_id, seq.num_computed_tokens, seq.token_ids,
                                     seq.request.cache_extra)

    # ---- decode ----

    def _decode_row(self, item: ScheduledSeq) -> DecodeRow:
        row = super()._decode_row(item)
        seq = item.seq
        live = self.states.live_slot(seq.slot_id)
        row = replace(row, state_read=self._read_slot(seq), state_write=live)
        self._pending.append((seq, live, row.position + 1))  # noted (and snapshotted) once the step ran
        return row

    # ---- verify rows ----

    def _verify(self, verify: list[ScheduledSeq]) -> dict[str, torch.Tensor]:
        """Each verify row's 1 + k positions as one chunk: logits [1 + k, vocab] per request."""
        input_ids, positions, slices = self._prepare(verify)
        token_slots: list[int] = []
        for item in verify:
            token_slots += self.states.verify_slots(item.seq.slot_id, item.num_new_tokens)
        states = RecurrentStates(self.states.tensors, [s.q_start for s in slices], [s.q_len for s in slices],
                                 [self._read_slot(i.seq) for i in verify],
                                 [self.states.live_slot(i.seq.slot_id) for i in verify], token_slots=token_slots)
        self._set_lora_rows(verify)
        ctx = AttentionContext(slices, self.kv_cache, self.device, states=states)
        if self.features is not None:  # a drafter reads the target's layers (an MTP head: F10)
            hidden = self._tapped_forward(input_ids, positions, ctx, verify, slices, None)
        else:
            hidden = self.model(input_ids, positions, ctx)
        logits = self.model.compute_logits(hidden).float()
        out: dict[str, torch.Tensor] = {}
        for item, sl in zip(verify, slices):
            seq = item.seq
            first = seq.num_computed_tokens
            for row, slot in enumerate(self.states.verify_slots(seq.slot_id, item.num_new_tokens)):
                self.states.wrote(slot, seq.request_id, first + row + 1)
            self.states.wrote(self.states.live_slot(seq.slot_id), seq.request_id, first + item.num_new_tokens)
            out[seq.request_id] = logits[sl.q_start:sl.q_start + sl.q_len]
        return out
