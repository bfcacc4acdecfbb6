"""Token-budget scheduler: each step, every running sequence's computed tokens catch up with its tokens.

Prefill chunks, prefix-cache hits and decode steps are one idea (vLLM v1): a sequence has
`num_tokens` (prompt + output) and `num_computed_tokens`; a step gives it up to the step's
remaining token budget. Running sequences go first, then waiting ones by priority.
When KV blocks run out, the newest running sequence is preempted and later recomputed.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from mlxcel.config import EngineConfig
from mlxcel.engine.kv import PrefixCache
from mlxcel.engine.dry import Dry
from mlxcel.engine.mirostat import with_mirostat
from mlxcel.engine.prompt_logprobs import prompt_token_logprobs
from mlxcel.engine.sampler import make_generator
from mlxcel.engine.spec import DraftPolicy, NoDrafter
from mlxcel.engine.vision import ImageEmbeddings, RopePositions, fit_chunk
from mlxcel.types import FinishReason, ImageCacheKeys, Request, TokenLogprob, lora_cache_extra

log = logging.getLogger(__name__)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    """Engine-side state of one request."""

    request: Request
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    kv_start: int = 0  # first live position (spec N)
    status: SeqStatus = SeqStatus.WAITING
    slot_id: int | None = None
    generator: torch.Generator | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None  # time.monotonic() of the first generated token
    prefill_start_time: float | None = None  # time.monotonic() of its first admission to a slot
    num_drafted: int = 0  # draft tokens verified for this request (B1-B4)
    num_draft_accepted: int = 0
    num_prompt_scored: int = 0  # prompt positions whose logits went out (a recomputation skips them)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # [None] + one per scored position, if asked
    is_prompt_logprobs_sent: bool = False
    image_embeds: ImageEmbeddings | None = None  # issue 43: encoded once its first chunk needs them (engine/vision.py)
    rope_positions: RopePositions | None = None  # issue 43: M-RoPE positions, once its first step needs them

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One sequence's share of a step: `num_new_tokens` positions, the last `len(draft)` of them
    draft tokens to verify (a decode row with a draft is a verify row)."""

    seq: Sequence
    num_new_tokens: int
    draft: tuple[int, ...] = ()

    @property
    def is_sampling(self) -> bool:
        """True when this step reaches the sequence's last token, so it yields logits."""
        return self.seq.num_computed_tokens + self.num_new_tokens - len(self.draft) == self.seq.num_tokens

    @property
    def is_decode(self) -> bool:
        """One known generated token (plus any draft): computed by the decode step.

        NOTE: a one-token prompt chunk (the tail left after a prefix-cache hit) is not: it takes the
        kernels the same position of a cold prompt takes (engine/runner.py: on the CPU the decode
        step's for a prompt's partial last block, else the prefill's), or a cache hit would change
        the tokens that follow. (The runner still sends the decode step a prompt's last token whose
        KV is cached, when the whole prompt hit: it writes no KV there.)"""
        return (self.num_new_tokens - len(self.draft) == 1
                and self.seq.num_computed_tokens >= self.seq.num_prompt_tokens)


@dataclass(slots=True)
class _StepBudget:
    """What one step may still compute: tokens in all (--batch-size) and prompt tokens (--ubatch-size)."""

    tokens: int
    prompt_tokens: int

    def __post_init__(self) -> None:
        self.prompt_tokens = min(self.prompt_tokens, self.tokens)

    def take(self, wanted: int, *, is_prompt: bool) -> int:
        """Up to `wanted` tokens (a prompt's only from the prompt budget) -> how many were granted."""
        granted = max(0, min(wanted, self.tokens, self.prompt_tokens if is_prompt else wanted))
        self.tokens -= granted
        self.prompt_tokens = min(self.prompt_tokens - (granted if is_prompt else 0), self.tokens)
        return granted

    def give_back(self, granted: int, *, is_prompt: bool) -> None:
        self.tokens += granted
        if is_prompt:
            self.prompt_tokens += granted


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(frozen=True, slots=True)
class StepResult:
    """One sequence's outcome after a step: new tokens and, at the end, why it finished."""

    seq: Sequence
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: FinishReason | None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # once, on the sequence's first result


@dataclass(frozen=True, slots=True)
class SlotContent:
    """What a slot's last sequence left in the prefix cache (F12): its computed tokens, the LoRA
    scales their KV was computed under and its images' placeholder spans (the cache keys blocks by all)."""

    token_ids: list[int]
    lora_scales: tuple[float, ...] = ()
    image_spans: tuple[tuple[int, int, str], ...] = ()  # ImageCacheKeys.spans: (first, end, digest) per run

    @property
    def cache_extra(self) -> object:
        """The prefix-cache `extra` this content's blocks were keyed by (Request.cache_extra's rule)."""
        base = lora_cache_extra(self.lora_scales)
        return ImageCacheKeys(base, self.image_spans) if self.image_spans else base


# Samples verify position i of a row (0 = the position after its known tokens), reading the
# sequence as it stands (its accepted tokens so far); returns the token and its logprob.
ChooseToken = Callable[[int], tuple[int, TokenLogprob | None]]


class Scheduler:
    def __init__(self, config: EngineConfig, kv: PrefixCache, *, slot_context: int,
                 eos_token_ids: frozenset[int], drafts: DraftPolicy | None = None) -> None:
        self.config = config
        self.kv = kv
        self.drafts = drafts or DraftPolicy(config.speculative, NoDrafter())
        self.slot_context = slot_context
        self.eos_token_ids = eos_token_ids
        self.waiting: list[tuple[int, float, int, Sequence]] = []  # heap by (priority, arrival, n)
        self.running: list[Sequence] = []
        self.sequences: dict[str, Sequence] = {}
        self._order = itertools.count()
        self.num_started = 0
        self.num_completed = 0
        self.num_aborted = 0  # sequences started and then aborted (a waiting one was never started)
        self.num_generated = 0
        self.num_prompt_computed = 0
        self.num_steps = 0
        self.failed_request_ids: list[str] = []  # rows that failed in update_from_output (issue 44)
        self.num_busy_slot_steps = 0
        self.max_sequence_len = 0
        self.slot_contents: dict[int, SlotContent] = {}  # what each slot last computed (F12 save)

    # ---- admission and removal ----

    def add_request(self, request: Request) -> Sequence:
        request = _with_sampling_processors(request)
        seq = Sequence(request=request, token_ids=list(request.prompt_token_ids),
                       num_prompt_tokens=len(request.prompt_token_ids),
                       generator=make_generator(request.sampling.seed),
                       prompt_logprobs=[None] if request.sampling.prompt_logprobs is not None else None)
        self.sequences[request.request_id] = seq
        self._push_waiting(seq)
        return seq

    def _push_waiting(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        entry = (int(seq.request.priority), seq.request.arrival_time, next(self._order), seq)
        heapq.heappush(self.waiting, entry)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.sequences.get(request_id)
        if seq is None or seq.status is SeqStatus.FINISHED:
            return None
        self._finish(seq, FinishReason.ABORT)
        return seq

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting = [e for e in self.waiting if e[3] is not seq]
            heapq.heapify(self.waiting)
        was_started = seq.status is SeqStatus.RUNNING or seq.num_preemptions > 0
        if seq.slot_id is not None:
            extra = seq.request.cache_extra
            spans = extra.spans if isinstance(extra, ImageCacheKeys) else ()
            self.slot_contents[seq.slot_id] = SlotContent(seq.token_ids[:seq.num_computed_tokens],
                                                          seq.request.lora_scales, spans)
        self.kv.free(seq.request_id)
        self.drafts.free(seq.request_id)
        seq.status, seq.finish_reason, seq.slot_id = SeqStatus.FINISHED, reason, None
        self.sequences.pop(seq.request_id, None)
        if reason is not FinishReason.ABORT:
            self.num_completed += 1
        elif was_started:
            self.num_aborted += 1

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- scheduling ----

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = _StepBudget(self.config.max_num_batched_tokens, self.config.max_num_prefill_tokens)
        self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: _StepBudget) -> None:
        for seq in list(self.running):
            if budget.tokens <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_left = seq.num_tokens - seq.num_computed_tokens
            is_prompt = num_left > 1 or seq.num_computed_tokens < seq.num_prompt_tokens  # not one decode row
            num_new = budget.take(num_left, is_prompt=is_prompt)
            if seq.request.image_inputs and (fitted := fit_chunk(seq, seq.num_computed_tokens, num_new)) < num_new:
                budget.give_back(num_new - fitted, is_prompt=is_prompt)
                num_new = fitted
            if num_new == 0:
                continue  # a prompt's next chunk, with the step's prompt tokens spent
            if not self._allocate_or_preempt(seq, num_new, out):
                budget.give_back(num_new, is_prompt=is_prompt)
                continue
            out.scheduled.append(ScheduledSeq(seq, num_new))

    def attach_drafts(self, out: SchedulerOutput) -> None:
        """Give the step's decode rows their drafts (B4), in the budget the schedule left.

        Called on the loop thread after `schedule`, outside the stats lock: a draft model's
        forward passes run here. A row whose extra KV does not fit simply decodes plainly.
        """
        budget = self.config.max_num_batched_tokens - out.num_tokens
        for index, item in enumerate(out.scheduled):
            if budget <= 0:
                return
            if not (item.is_decode and item.is_sampling) or item.seq.status is not SeqStatus.RUNNING:
                continue
            draft = self._draft(item.seq, budget + 1)
            if draft and self._allocate(item.seq, 1 + len(draft)):
                out.scheduled[index] = ScheduledSeq(item.seq, 1 + len(draft), draft)
                budget -= len(draft)

    def _draft(self, seq: Sequence, num_positions: int) -> tuple[int, ...]:
        """Draft tokens for decode row `seq`: at most `num_positions - 1`, and within max_tokens and the context."""
        if self.config.max_kv_size:
            return ()  # NOTE: a sliding window moves per token; a verify row would see other keys
        room = min(num_positions, self.slot_context - seq.num_tokens) - 1
        max_tokens = seq.request.sampling.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - seq.num_output_tokens - 1)
        return self.drafts.draft(seq, len(self.running), room)

    def _allocate(self, seq: Sequence, num_new: int) -> bool:
        """Room for `num_new` positions without preempting anyone (a draft is never worth a preemption)."""
        return self.kv.allocate(seq.request_id, seq.token_ids, seq.num_computed_tokens, num_new,
                                cache_prompt=seq.request.cache_prompt) is not None

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        while self.kv.allocate(seq.request_id, seq.token_ids, seq.num_computed_tokens, num_new,
                               cache_prompt=seq.request.cache_prompt, extra=seq.request.cache_extra) is None:
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        # Recompute later: the generated tokens stay, the KV is rebuilt from them.
        log.info("preempting %s (KV blocks exhausted); it will be recomputed", seq.request_id)
        self.running.remove(seq)
        self.kv.free(seq.request_id)
        self.drafts.free(seq.request_id)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        seq.num_computed_tokens, seq.kv_start, seq.slot_id = 0, 0, None
        seq.num_preemptions += 1
        out.preempted.append(seq)
        self._push_waiting(seq)

    def _schedule_waiting(self, out: SchedulerOutput, budget: _StepBudget) -> None:
        while self.waiting and budget.prompt_tokens > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0][3]
            slot = self._free_slot(seq.request.slot_id)
            if slot is None:
                return
            # NOTE: a request that wants every prompt position's logits reads no cached prefix (it may donate)
            is_reading = seq.request.cache_prompt and not seq.request.wants_prompt_logits
            cached, num_cached = self.kv.find_cached_prefix(seq.token_ids, cache_prompt=is_reading,
                                                            extra=seq.request.cache_extra, include_last_block=True)
            num_new = min(seq.num_tokens - num_cached, budget.prompt_tokens)
            if seq.request.image_inputs:
                num_new = fit_chunk(seq, num_cached, num_new)
            new_blocks = self.kv.allocate(seq.request_id, seq.token_ids, num_cached, num_new, cached,
                                          cache_prompt=seq.request.cache_prompt, extra=seq.request.cache_extra)
            if new_blocks is None:
                return
            heapq.heappop(self.waiting)
            self._admit(seq, slot, num_cached)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget.take(num_new, is_prompt=True)

    def _admit(self, seq: Sequence, slot: int, num_cached: int) -> None:
        if seq.num_preemptions == 0:
            self.num_started += 1
            seq.num_cached_tokens = num_cached
            seq.prefill_start_time = time.monotonic()
        seq.num_computed_tokens = num_cached
        seq.status, seq.slot_id = SeqStatus.RUNNING, slot
        self.running.append(seq)

    def _free_slot(self, wanted: int | None) -> int | None:
        used = {s.slot_id for s in self.running}
        if wanted is not None and 0 <= wanted < self.config.max_num_seqs:
            return None if wanted in used else wanted
        return next((i for i in range(self.config.max_num_seqs) if i not in used), None)

    # ---- after the forward pass ----

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, tuple[int, TokenLogprob | None]]) -> list[StepResult]:
        """Apply a step's sampled tokens to its rows without a draft (verify rows: `update_verified`)."""
        results: list[StepResult] = []
        self.num_steps += 1
        self.num_busy_slot_steps += len(self.running)
        for item in out.scheduled:
            try:
                result = self._update_row(item, sampled)
            except Exception:  # noqa: BLE001 - issue 44: one request's processor failing fails it alone
                log.exception("request %s: taking its sampled token failed; failing it", item.seq.request_id)
                self.failed_request_ids.append(item.seq.request_id)
                continue
            if result is not None:
                results.append(result)
        return results

    def take_failed(self) -> list[str]:
        """The requests whose row failed in `update_from_output` since the last call (the loop fails them)."""
        failed, self.failed_request_ids = self.failed_request_ids, []
        return failed

    def _update_row(self, item: ScheduledSeq, sampled: dict[str, tuple[int, TokenLogprob | None]]) -> StepResult | None:
        seq = item.seq
        if seq.status is not SeqStatus.RUNNING or item.draft:
            return None
        self._count_prompt_progress(seq, item.num_new_tokens)
        seq.num_computed_tokens += item.num_new_tokens
        self.max_sequence_len = max(self.max_sequence_len, seq.num_computed_tokens)
        if seq.request_id not in sampled:
            return None
        if seq.request.sampling.max_tokens == 0:  # the prompt alone was asked for (echo, prompt logprobs)
            result = StepResult(seq, (), None, FinishReason.LENGTH, self._take_prompt_logprobs(seq))
            self._finish(seq, FinishReason.LENGTH)
            return result
        token, logprob = sampled[seq.request_id]
        reason = self._append_token(seq, token)
        result = StepResult(seq, (token,), (logprob,) if logprob else None, reason, self._take_prompt_logprobs(seq))
        self._after_tokens(seq, reason)
        return result

    def record_prompt_logits(self, seq: Sequence, first: int, logits: torch.Tensor) -> None:
        """The runner's logits [n, vocab] of prompt positions first..first+n-1 (each predicting the next
        prompt token): to the request's own sink, and as prompt logprobs when asked."""
        request = seq.request
        if request.prompt_logits is not None:
            request.prompt_logits(first, logits)
        num_top = request.sampling.prompt_logprobs
        if num_top is not None and seq.prompt_logprobs is not None:
            targets = seq.token_ids[first + 1:first + 1 + logits.shape[0]]
            seq.prompt_logprobs.extend(prompt_token_logprobs(logits, targets, num_top))
        seq.num_prompt_scored = first + logits.shape[0]

    @staticmethod
    def _take_prompt_logprobs(seq: Sequence) -> tuple[TokenLogprob | None, ...] | None:
        """The prompt's logprobs, once: with the first result after the whole prompt was computed."""
        if seq.prompt_logprobs is None or seq.is_prompt_logprobs_sent:
            return None
        seq.is_prompt_logprobs_sent = True
        return tuple(seq.prompt_logprobs)

    def update_verified(self, item: ScheduledSeq, choose: ChooseToken) -> StepResult | None:
        """Accept a verify row's tokens one at a time (B4): token i is the target's choice at its
        position given the tokens accepted before it; the draft ends at the first mismatch or
        finish, so the stream is the one plain decoding would give.

        KV past the accepted positions stays written but unused (`num_computed_tokens` rolls
        back to the last accepted position); the next steps overwrite it in place.
        """
        seq = item.seq
        if seq.status is not SeqStatus.RUNNING:
            return None
        tokens: list[int] = []
        logprobs: list[TokenLogprob] = []
        reason: FinishReason | None = None
        for i in range(len(item.draft) + 1):
            token, logprob = choose(i)
            reason = self._append_token(seq, token)
            tokens.append(token)
            logprobs += [logprob] if logprob else []
            if reason is not None or i == len(item.draft) or token != item.draft[i]:
                break
        num_accepted = sum(t == d for t, d in zip(tokens, item.draft))
        seq.num_computed_tokens += len(tokens)  # the known token and the accepted drafts
        seq.num_drafted += len(item.draft)
        seq.num_draft_accepted += num_accepted
        self.drafts.record(seq.request_id, len(item.draft), num_accepted)
        result = StepResult(seq, tuple(tokens), tuple(logprobs) if logprobs else None, reason)
        self._after_tokens(seq, reason)
        return result

    def _append_token(self, seq: Sequence, token: int) -> FinishReason | None:
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        self.num_generated += 1
        return self._check_finish(seq, token)

    def _after_tokens(self, seq: Sequence, reason: FinishReason | None) -> None:
        if reason is not None:
            self._finish(seq, reason)
        else:
            self._slide_window(seq)

    def _count_prompt_progress(self, seq: Sequence, num_new: int) -> None:
        prompt_left = max(seq.num_prompt_tokens - seq.num_computed_tokens, 0)
        self.num_prompt_computed += min(prompt_left, num_new)

    def _check_finish(self, seq: Sequence, token: int) -> FinishReason | None:
        for processor in seq.request.processors:
            if (reason := processor.accept(token)) is not None:
                return reason
        params = seq.request.sampling
        is_stop_token = token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)
        if is_stop_token and seq.num_output_tokens > params.min_tokens:
            return FinishReason.STOP
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.slot_context and not self.config.max_kv_size:
            return FinishReason.LENGTH
        return None

    def _slide_window(self, seq: Sequence) -> None:
        # Spec N: keep only the newest max_kv_size tokens live; positions never move back.
        limit = self.config.max_kv_size
        if limit and seq.num_tokens - seq.kv_start > limit:
            seq.kv_start = seq.num_tokens - limit
            self.kv.free_prefix(seq.request_id, seq.kv_start)


def _with_sampling_processors(request: Request) -> Request:
    """The request with its own state for the samplers that keep one: mirostat (its bound) and DRY (the prompt)."""
    request = with_mirostat(request)
    if request.sampling.dry_multiplier != 0.0:
        request = replace(request, processors=(*request.processors, Dry(request.sampling, request.prompt_token_ids)))
    return request
