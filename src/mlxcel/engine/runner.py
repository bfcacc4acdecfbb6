"""Batch -> tensors -> model -> logits for the rows that sample this step.

A step's single-token rows (decode) go through the decode step (engine/decode_step.py:
compiled on CPU, CUDA graphs on GPU), its prefill chunks through the model's eager forward.
A decode row is therefore computed the same way whatever else shares its step.
"""

from __future__ import annotations

import torch

from mlxcel.engine.decode_step import DecodeRow, DecodeStep
from mlxcel.engine.prefix_cache import KVCacheManager
from mlxcel.engine.scheduler import ScheduledSeq, SchedulerOutput
from mlxcel.layers.attention import AttentionContext, KVCache, SequenceSlice


class Runner:
    """Owns the model and the KV tensors; called only from the engine loop's thread."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, kv: KVCacheManager,
                 device: torch.device | str, decode_step: DecodeStep) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv = kv
        self.device = torch.device(device)
        self.decode_step = decode_step

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[list[str], torch.Tensor]:
        """Run one step; returns the sampling rows' request ids and their logits [N, vocab] (float32, CPU)."""
        decode = [s for s in out.scheduled if s.num_new_tokens == 1]
        prefill = [s for s in out.scheduled if s.num_new_tokens != 1]
        ids: list[str] = []
        parts: list[torch.Tensor] = []
        if decode:
            logits = self.decode_step.run([self._decode_row(s) for s in decode])
            keep = [i for i, s in enumerate(decode) if s.is_sampling]
            ids += [decode[i].seq.request_id for i in keep]
            parts.append(logits if len(keep) == len(decode) else logits[keep])
        if prefill:
            prefill_ids, logits = self._prefill(prefill)
            ids += prefill_ids
            parts.append(logits)
        if not ids:
            return [], torch.empty(0)
        return ids, torch.cat(parts) if len(parts) > 1 else parts[0]

    def _decode_row(self, item: ScheduledSeq) -> DecodeRow:
        seq = item.seq
        position = seq.num_computed_tokens
        return DecodeRow(seq.token_ids[position], position, seq.kv_start,
                         tuple(self.kv.block_table(seq.request_id)))

    def _prefill(self, scheduled: list[ScheduledSeq]) -> tuple[list[str], torch.Tensor]:
        input_ids, positions, slices = self._prepare(scheduled)
        ctx = AttentionContext(slices, self.kv_cache, self.device)
        with ctx.active():
            hidden = self.model(input_ids, positions, ctx)
        rows = [(s.seq.request_id, sl.q_start + sl.q_len - 1)
                for s, sl in zip(scheduled, slices) if s.is_sampling]
        if not rows:
            return [], torch.empty(0)
        index = torch.tensor([r[1] for r in rows], device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        return [r[0] for r in rows], logits.float().cpu()

    def _prepare(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, list[SequenceSlice]]:
        ids: list[int] = []
        pos: list[int] = []
        slices: list[SequenceSlice] = []
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            stop = start + item.num_new_tokens
            slices.append(SequenceSlice(q_start=len(ids), q_len=item.num_new_tokens, kv_len=stop,
                                        kv_start=seq.kv_start,
                                        block_table=tuple(self.kv.block_table(seq.request_id))))
            ids.extend(seq.token_ids[start:stop])
            pos.extend(range(start, stop))
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(ids), as_tensor(pos), slices
