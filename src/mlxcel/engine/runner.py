"""Batch -> tensors -> model -> logits for the rows that sample this step.

A step's single-token rows (decode) go through the decode step (engine/decode_step.py:
compiled on CPU, CUDA graphs on GPU), its prefill chunks through the model's eager forward.
A decode row is therefore computed the same way whatever else shares its step. When a whole
prompt was cached (every block a hit), its last token only needs logits: it goes through the
decode step too, reading its own cached key and writing no KV. On the CPU, the positions of a
prompt past its last whole KV block (its "tail", when 1-4 positions) go through the decode step as
well, as single-token rows, whether the prompt came cold or after a hit (`Runner._split_tails`).

A verify row (a decode row with k draft tokens, B4) becomes k + 1 single-token rows of the
decode step at positions p..p+k: each writes its key first and attends over the keys up to its
own position, so the step is causal over the draft and every position's logits have the bits a
plain decode step at that position would give.

A request that wants its prompt's logits (`Request.wants_prompt_logits`: prompt logprobs, `mlxcel
perplexity`) gets every prompt position's logits from its prefill chunks, in blocks, through the
prompt-logits sink (the scheduler's `record_prompt_logits`); such a request reads no cached prefix.

With a feature sink (a DFlash drafter, engine/spec/dflash.py), every computed position's outputs
of the tapped decoder layers go to it: (request id, first position, features [n, taps x hidden]).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mlxcel.engine.decode_step import DecodeRow, DecodeStep
from mlxcel.engine.kv import PrefixCache
from mlxcel.engine.kv.tensors import KVCache
from mlxcel.engine.prompt_logprobs import PROMPT_LOGITS_BLOCK
from mlxcel.engine.scheduler import ScheduledSeq, SchedulerOutput, Sequence
from mlxcel.engine.vision import (
    bidirectional_spans, embedding_override, encode_pending, has_placeholders, rope_offset, step_positions,
)
from mlxcel.layers.attention import AttentionContext, SequenceSlice
from mlxcel.layers.decoder import EmbeddingOverride
from mlxcel.layers.lora import model_lora_rows, token_scales


@dataclass(frozen=True, slots=True)
class StepLogits:
    """What one step yields: logits [N, vocab] (float32, on the model's device) of the N sampling rows without a
    draft, in `request_ids` order, and each verify row's logits [1 + len(draft), vocab]."""

    request_ids: list[str]
    logits: torch.Tensor
    verify: dict[str, torch.Tensor]


# The most tail rows the decode step takes (more stay in the prefill): each costs a weight-bound row there,
# and a cold prompt with a tail pays a second pass over the weights. In-process, 2 threads, native step:
# SmolLM2 gains at every tail length after a 2,000-token hit (15 rows: 60 vs 84 ms), Qwen2.5-1.5B only
# up to 4 (4: 75 vs 91 ms; 8: 146 vs 139) and a cold 24-token prompt lost 48 ms with 8 (bench/RESULTS.md).
MAX_TAIL_ROWS = 4


@dataclass(frozen=True, slots=True)
class _Tail:
    """The part of prefill chunk `item` past its sequence's last whole block: positions first..first+num_rows-1,
    computed as single-token rows of the decode step (`Runner._split_tails`)."""

    item: ScheduledSeq
    first: int
    num_rows: int


FeatureSink = Callable[[str, int, torch.Tensor], None]
PromptLogitsSink = Callable[[Sequence, int, torch.Tensor], None]  # (sequence, first position, logits [n, vocab])


class Runner:
    """Owns the model and the KV tensors; called only from the engine loop's thread."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, kv: PrefixCache,
                 device: torch.device | str, decode_step: DecodeStep, features: FeatureSink | None = None,
                 prompt_logits: PromptLogitsSink | None = None) -> None:
        self.model = model
        self.features = features  # fed when the decode step has taps
        self.prompt_logits = prompt_logits
        self.kv_cache = kv_cache
        self.kv = kv
        self.device = torch.device(device)
        self.decode_step = decode_step
        # A GPU keeps every prompt position in its prefill chunks: its decode step is captured for at most
        # one row a slot (CUDA graphs), and its batched prefill has no per-layer cost to save.
        self.decode_tails = self.device.type == "cpu"

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepLogits:
        """Run one step: logits for the rows that sample (plain rows and verify rows apart)."""
        decode = [s for s in out.scheduled if (s.is_decode and not s.draft) or self._is_cached_token(s)]
        verify = [s for s in out.scheduled if s.is_decode and s.draft]
        prefill, tails = self._split_tails([s for s in out.scheduled if not s.is_decode and not self._is_cached_token(s)])
        ids: list[str] = []
        parts: list[torch.Tensor] = []
        verified: dict[str, torch.Tensor] = {}
        if tails:  # the tail rows read the keys this step's prefill chunks write: those first
            self._run_prefill(prefill, ids, parts)
        if decode or verify or tails:
            rows = ([self._decode_row(s) for s in decode] + [r for t in tails for r in self._tail_rows(t)]
                    + [r for s in verify for r in self._verify_rows(s)])
            logits = self.decode_step.run(rows)
            keep = [i for i, s in enumerate(decode) if s.is_sampling]
            ids += [decode[i].seq.request_id for i in keep]
            if decode:
                parts.append(logits[:len(decode)] if len(keep) == len(decode) else logits[keep])
            start = len(decode)
            for tail in tails:
                end = start + tail.num_rows
                self._send_tail_logits(tail, logits[start:end], ids, parts)
                start = end
            verified = self._split_verify(verify, logits[start:])
            if self.features is not None:
                self._send_step_features(decode, tails, verify)
        if not tails:  # on a GPU (no tail rows) the decode step is launched before the prefill's host work
            self._run_prefill(prefill, ids, parts)
        merged = (torch.cat(parts) if len(parts) > 1 else parts[0]) if parts else torch.empty(0, device=self.device)
        return StepLogits(ids, merged, verified)

    def _run_prefill(self, prefill: list[ScheduledSeq], ids: list[str], parts: list[torch.Tensor]) -> None:
        if prefill:
            prefill_ids, logits = self._prefill(prefill)
            ids += prefill_ids
            if prefill_ids:  # chunks that do not sample yet add nothing (and no host tensor beside GPU logits)
                parts.append(logits)

    def _split_tails(self, chunks: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], list[_Tail]]:
        """On the CPU, the positions of each chunk past its sequence's last whole block go to the decode
        step as single-token rows (a `_Tail`) when the sequence has at most MAX_TAIL_ROWS of them; the
        rest stays a prefill chunk.

        The split is by position, not by how the prompt arrived: a prompt's whole blocks take the
        prefill's kernels and its partial last block the decode step's, whether it came cold, in chunks
        or after a prefix-cache hit (which covers whole blocks only), so each way gives the same bits.
        After a hit the tail costs far less so: after 2,000 cached keys (SmolLM2 Q4_1, 2 threads, native
        step) 2 new tokens took 56 ms as a prefill chunk (each layer gathering and converting every
        cached key for torch's attention) and 15 ms as decode rows. A cold prompt with a tail pays a
        second pass over the weights: SmolLM2 2-5 ms on 20-100 tokens (issue 25 point 3)."""
        if not self.decode_tails:
            return chunks, []
        prefill: list[ScheduledSeq] = []
        tails: list[_Tail] = []
        for item in chunks:
            seq = item.seq
            start, stop = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
            num_tail = seq.num_tokens % self.kv_cache.block_size
            first = max(start, seq.num_tokens - num_tail) if num_tail <= MAX_TAIL_ROWS else stop
            if seq.request.image_inputs and has_placeholders(seq, first, stop):
                first = stop  # the decode step embeds tokens only: image rows stay in the prefill
            if first > start:
                prefill.append(item if first >= stop else ScheduledSeq(seq, first - start))
            if first < stop:
                tails.append(_Tail(item, first, stop - first))
        return prefill, tails

    def _tail_rows(self, tail: _Tail) -> list[DecodeRow]:
        seq = tail.item.seq
        return self._rows(seq, tail.first, seq.token_ids[tail.first:tail.first + tail.num_rows])

    def _send_tail_logits(self, tail: _Tail, logits: torch.Tensor, ids: list[str], parts: list[torch.Tensor]) -> None:
        """A tail's logits [rows, vocab]: its prompt positions' to the prompt-logits sink, the last one's to
        the sampler when the tail ends the sequence."""
        seq = tail.item.seq
        if self.prompt_logits is not None and seq.request.wants_prompt_logits:
            first, stop = _unscored_prompt_positions(seq, tail.first, tail.num_rows)
            if first < stop:
                self.prompt_logits(seq, first, logits[first - tail.first:stop - tail.first])
        if tail.item.is_sampling:
            ids.append(seq.request_id)
            parts.append(logits[-1:])

    def _is_cached_token(self, item: ScheduledSeq) -> bool:
        """A prompt's last token whose KV came with a prefix-cache hit (the whole prompt was cached).

        It needs only its logits: the decode step computes them over the cached keys and writes no KV,
        so the shared block keeps the bits the whole prompt's prefill gave it."""
        seq = item.seq
        return (not item.is_decode and item.num_new_tokens == 1
                and seq.num_computed_tokens < self.kv.num_cached_tokens(seq.request_id))

    def _writes_kv(self, seq: Sequence, position: int) -> bool:
        return position >= self.kv.num_cached_tokens(seq.request_id)  # a hit block may be shared: never write it

    def _decode_row(self, item: ScheduledSeq) -> DecodeRow:
        seq = item.seq
        position = seq.num_computed_tokens
        return DecodeRow(seq.token_ids[position], position, seq.kv_start,
                         tuple(self.kv.block_table(seq.request_id)), seq.request.lora_scales,
                         self._writes_kv(seq, position), rope_offset(self.model, seq))

    def _verify_rows(self, item: ScheduledSeq) -> list[DecodeRow]:
        """The known token and each draft token as one single-token row at its own position."""
        seq = item.seq
        return self._rows(seq, seq.num_computed_tokens, (seq.token_ids[seq.num_computed_tokens], *item.draft))

    def _rows(self, seq: Sequence, first: int, tokens: tuple[int, ...] | list[int]) -> list[DecodeRow]:
        table = tuple(self.kv.block_table(seq.request_id))
        offset = rope_offset(self.model, seq)
        return [DecodeRow(token, first + i, seq.kv_start, table, seq.request.lora_scales,
                          self._writes_kv(seq, first + i), offset)
                for i, token in enumerate(tokens)]

    @torch.inference_mode()
    def extend(self, seq: Sequence, num_new: int) -> torch.Tensor:
        """Compute `seq`'s next `num_new` positions as single-token rows of one decode step (as a verify
        row does; a draft model catches up on accepted tokens so); the last position's logits [1, vocab]."""
        first = seq.num_computed_tokens
        return self.decode_step.run(self._rows(seq, first, seq.token_ids[first:first + num_new]))[-1:]

    @staticmethod
    def _split_verify(verify: list[ScheduledSeq], logits: torch.Tensor) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        start = 0
        for item in verify:
            out[item.seq.request_id] = logits[start:start + 1 + len(item.draft)]
            start += 1 + len(item.draft)
        return out

    def _send_step_features(self, decode: list[ScheduledSeq], tails: list[_Tail], verify: list[ScheduledSeq]) -> None:
        tapped = self.decode_step.tapped
        for i, item in enumerate(decode):
            self.features(item.seq.request_id, item.seq.num_computed_tokens, tapped[i:i + 1])
        start = len(decode)
        for tail in tails:
            self.features(tail.item.seq.request_id, tail.first, tapped[start:start + tail.num_rows])
            start += tail.num_rows
        for item in verify:
            self.features(item.seq.request_id, item.seq.num_computed_tokens, tapped[start:start + 1 + len(item.draft)])
            start += 1 + len(item.draft)

    def _prefill(self, scheduled: list[ScheduledSeq]) -> tuple[list[str], torch.Tensor]:
        encode_pending(self.model, scheduled)  # issue 43: the step's new images, one batch
        input_ids, positions, slices = self._prepare(scheduled)
        ctx = AttentionContext(slices, self.kv_cache, self.device, prefill_only=True)
        self._set_lora_rows(scheduled)
        embeds = embedding_override(scheduled, slices, self.device)
        if self.features is not None:  # set only when the decode step has taps
            hidden = self._tapped_forward(input_ids, positions, ctx, scheduled, slices, embeds)
        elif embeds is not None:
            hidden = self.model(input_ids, positions, ctx, embeds)
        else:
            hidden = self.model(input_ids, positions, ctx)
        self._send_prompt_logits(scheduled, slices, hidden)  # the final norm's output, as the head takes it
        rows = [(s.seq.request_id, sl.q_start + sl.q_len - 1)
                for s, sl in zip(scheduled, slices) if s.is_sampling]
        if not rows:
            return [], torch.empty(0)
        index = torch.tensor([r[1] for r in rows], device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        return [r[0] for r in rows], logits.float()

    def _send_prompt_logits(self, scheduled: list[ScheduledSeq], slices: list[SequenceSlice],
                            hidden: torch.Tensor) -> None:
        """Logits of the chunk's prompt positions that predict a prompt token, for requests that want them
        (positions sent before a preemption are not sent again)."""
        for item, sl in zip(scheduled, slices):
            seq = item.seq
            if self.prompt_logits is None or not seq.request.wants_prompt_logits:
                continue
            start = seq.num_computed_tokens
            first, stop = _unscored_prompt_positions(seq, start, item.num_new_tokens)
            for block in range(first, stop, PROMPT_LOGITS_BLOCK):
                end = min(block + PROMPT_LOGITS_BLOCK, stop)
                rows = hidden[sl.q_start + block - start:sl.q_start + end - start]
                self.prompt_logits(seq, block, self.model.compute_logits(rows).float())

    def _tapped_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                        scheduled: list[ScheduledSeq], slices: list[SequenceSlice],
                        embeds: EmbeddingOverride | None) -> torch.Tensor:
        """The model's forward (embedding, layers, final norm: the same ops), sending the tapped layers' outputs."""
        inner, taps = self.model.model, self.decode_step.taps
        outputs: dict[int, torch.Tensor] = {}
        x = inner.embed(input_ids)
        if embeds is not None:
            x = embeds.apply(x)
        for index, layer in enumerate(inner.layers):
            x = layer(x, positions, ctx)
            if index in taps:
                outputs[index] = x
        features = torch.cat([outputs[i] for i in taps], dim=-1)
        for item, sl in zip(scheduled, slices):
            self.features(item.seq.request_id, item.seq.num_computed_tokens, features[sl.q_start:sl.q_start + sl.q_len])
        return inner.norm(x)

    def _set_lora_rows(self, scheduled: list[ScheduledSeq]) -> None:
        """F8: each prefill token gets its request's adapter scales (rows of one step may differ)."""
        rows = model_lora_rows(self.model)
        if rows is not None:
            rows.set_rows(token_scales(rows, [s.seq.request.lora_scales for s in scheduled],
                                       [s.num_new_tokens for s in scheduled], self.device))

    def _prepare(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, list[SequenceSlice]]:
        ids: list[int] = []
        spans: list[tuple[Sequence, int, int]] = []
        slices: list[SequenceSlice] = []
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            stop = start + item.num_new_tokens
            slices.append(SequenceSlice(q_start=len(ids), q_len=item.num_new_tokens, kv_len=stop,
                                        kv_start=seq.kv_start,
                                        block_table=tuple(self.kv.block_table(seq.request_id)),
                                        bidirectional=bidirectional_spans(seq) if seq.request.image_inputs else ()))
            ids.extend(seq.token_ids[start:stop])
            spans.append((seq, start, stop))
        pos = step_positions(self.model, spans)  # [T], or M-RoPE's [3, T]
        as_tensor = lambda xs: torch.as_tensor(xs, dtype=torch.long).to(self.device)  # noqa: E731
        return as_tensor(ids), as_tensor(pos), slices


def _unscored_prompt_positions(seq: Sequence, start: int, count: int) -> tuple[int, int]:
    """Of positions start..start+count-1, those whose logits predict a prompt token and have not gone out yet
    (a recomputation after a preemption skips them): [first, stop), empty when first >= stop."""
    return max(start, seq.num_prompt_scored), min(start + count, seq.num_prompt_tokens - 1)
