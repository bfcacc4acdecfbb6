"""Batch -> tensors -> model -> logits for the rows that sample this step."""

from __future__ import annotations

import torch

from mlxcel.engine.prefix_cache import KVCacheManager
from mlxcel.engine.scheduler import ScheduledSeq, SchedulerOutput
from mlxcel.layers.attention import AttentionContext, KVCache, SequenceSlice


class Runner:
    """Owns the model and the KV tensors; called only from the engine loop's thread."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, kv: KVCacheManager,
                 device: torch.device | str) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv = kv
        self.device = torch.device(device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[list[str], torch.Tensor]:
        """Run one step; returns the sampling rows' request ids and their logits [N, vocab] (float32, CPU)."""
        scheduled = single_token_rows_first(out)
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


def single_token_rows_first(out: SchedulerOutput) -> list[ScheduledSeq]:
    """Decode rows lead the flat batch, so per-row kernels (layers/quant.py) split it once."""
    return sorted(out.scheduled, key=lambda item: item.num_new_tokens != 1)
