"""Run one API call's generations and assemble their text; shared by every protocol adapter.

A `Generation` submits one engine `Request` per choice (n choices for each prompt), feeds each
choice's TokenEvents through a `TextAssembler` (detokenizer + stop strings), converts logprobs
to text, and yields protocol-neutral `ChoiceDelta`s (streaming) or `ChoiceResult`s (collected).
Protocol adapters only translate these to their JSON; none of this knows any wire format.

Chat features plug in per choice through GenerationParams: `processors` (grammar mask, reasoning
budget, loop guard: fresh TokenProcessors for each engine Request) and `output_parser` (reasoning /
tool-call split, chat/events.py). With a parser the stop strings are the parser's: they apply to
the answer, never to reasoning, and each delta carries the parser's `events`.

    generation = Generation.start(ctx, [Prompt(ids)], params, n=2, request_id="chatcmpl-1")
    async for delta in generation.stream(): ...       # or: results = await generation.collect()
    usage = generation.usage()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from mlxcel.api.context import ApiContext, SequenceRecord
from mlxcel.api.errors import ApiError, from_engine_error, invalid_request
from mlxcel.engine.client import DecodeTimeoutError, RequestStream
from mlxcel.chat.output import ParsedReply
from mlxcel.chat.events import ContentDelta, OutputEvent, ReasoningDelta
from mlxcel.text.output import TextAssembler
from mlxcel.text.tokenizer import Tokenizer
from mlxcel.types import (
    EngineError, FinishReason, ImageInput, Priority, PromptProgress, Request, SamplingParams, TokenEvent, TokenLogprob,
    TokenProcessor, Usage,
)

log = logging.getLogger(__name__)
INTERNAL_ERROR_MESSAGE = "internal server error; see the server log"


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt's token ids, and its text when the caller has it (for echo)."""

    token_ids: tuple[int, ...]
    text: str | None = None
    images: tuple[bytes, ...] = ()  # U: encoded images, one per image marker in the prompt, in order
    image_inputs: tuple[ImageInput, ...] = ()  # issue 43: the processed images of a vision-language model


class OutputParser(Protocol):
    """One choice's text deltas -> events (chat/output.py, chat/completion_output.py)."""

    @property
    def stop(self) -> str | None:
        """The stop string that ended the output (then generation ends)."""

    def feed(self, text: str) -> list[OutputEvent]: ...

    def finish(self) -> list[OutputEvent]: ...

    def result(self) -> ParsedReply: ...


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """Everything but the prompt: sampling, stop strings and scheduling (L, M), chat features."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    priority: Priority = Priority.NORMAL
    cache_prompt: bool = True
    slot_id: int | None = None
    skip_special_tokens: bool = True
    lora: tuple[tuple[int, float], ...] | None = None  # F8: a request's `lora` [(id, scale)]; None = global scales
    report_progress: bool = False  # llama-server return_progress: progress deltas while the prompt is computed
    # Fresh TokenProcessors for one choice's engine Request (grammar, reasoning budget, loop guard).
    processors: Callable[[Prompt], tuple[TokenProcessor, ...]] | None = None
    # One choice's parser, given the prompt and `stop`; it then owns the stop strings.
    output_parser: Callable[[Prompt, tuple[str, ...]], OutputParser] | None = None


@dataclass(frozen=True, slots=True)
class LogprobText:
    """A token's log-probability with its text and raw bytes (what every protocol reports)."""

    token_id: int
    token: str
    logprob: float
    bytes: tuple[int, ...]
    top: tuple[LogprobText, ...] = ()


@dataclass(frozen=True, slots=True)
class PromptLogprobText:
    """A prompt token's text, and its logprob (`entry.top`: the N best alternatives) with its rank
    (1 = most likely); the first token has no context, so no `entry`."""

    token: LogprobText
    entry: LogprobText | None
    rank: int | None


PromptLogprobs = tuple[PromptLogprobText, ...]  # one per prompt token


@dataclass(frozen=True, slots=True)
class ChoiceDelta:
    """What one engine step added to one choice; `finish_reason` is set on its last delta."""

    index: int
    text: str
    logprobs: tuple[LogprobText, ...] = ()
    finish_reason: str | None = None  # "stop", "length", "abort", "loop"
    stop: str | None = None  # the stop string that ended the text
    token_ids: tuple[int, ...] = ()  # tokens generated since the previous delta (llama-server `tokens`)
    events: tuple[OutputEvent, ...] = ()  # the output parser's events (with GenerationParams.output_parser)
    progress: PromptProgress | None = None  # a prompt-progress delta (no text), with report_progress
    prompt_logprobs: PromptLogprobs | None = None  # on the choice's first delta, when asked (sampling.prompt_logprobs)


@dataclass(frozen=True, slots=True)
class ChoiceTimings:
    submitted_at: float
    first_token_at: float | None
    finished_at: float

    @property
    def prefill_s(self) -> float:
        return (self.first_token_at or self.finished_at) - self.submitted_at

    @property
    def decode_s(self) -> float:
        return self.finished_at - (self.first_token_at or self.finished_at)


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    index: int
    prompt_index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[LogprobText, ...]
    finish_reason: str
    stop: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    timings: ChoiceTimings
    reply: ParsedReply | None = None  # the output parser's result (with GenerationParams.output_parser)
    num_generated: int | None = None  # a snapshot's token count (it carries no token_ids)
    num_drafted: int = 0  # speculative draft tokens verified (B1-B4), and the accepted ones
    num_draft_accepted: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # with sampling.prompt_logprobs

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) if self.num_generated is None else self.num_generated


class _Choice:
    """One engine request and the text assembled from it."""

    def __init__(self, ctx: ApiContext, index: int, prompt_index: int, prompt: Prompt,
                 params: GenerationParams, stream: RequestStream) -> None:
        self.ctx = ctx
        self.index = index
        self.prompt_index = prompt_index
        self.stream = stream
        self.logprobs_n = params.sampling.logprobs
        self.prompt_logprobs: PromptLogprobs | None = None
        self.parser = params.output_parser(prompt, params.stop) if params.output_parser is not None else None
        stops = params.stop if self.parser is None else ()  # a parser matches stops on the answer itself
        self.assembler = TextAssembler(ctx.tokenizer, stops=stops, skip_special_tokens=params.skip_special_tokens,
                                       context_token_ids=prompt.token_ids)
        # End tokens are not text, so their logprobs are left out; but a prompt-logprobs client (lm-eval's
        # local-completions) counts the entries after the prompt's, so there every generated token stays.
        self.hidden = ctx.tokenizer.eos_token_ids if params.sampling.prompt_logprobs is None else frozenset()
        self.num_prompt_tokens = len(prompt.token_ids)
        self.prompt_token_ids = prompt.token_ids
        self.num_cached_tokens = 0
        self.num_drafted = self.num_draft_accepted = 0
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.unsent_ids: list[int] = []  # generated but not yet carried by a delta
        self.logprobs: list[LogprobText] = []
        self.finish_reason: str | None = None
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    def apply(self, event: TokenEvent) -> ChoiceDelta | None:
        """Turn one TokenEvent into a delta (None when it produced nothing to send).

        An event of several tokens (accepted speculative drafts) is applied token by token, so a
        stop string or parser stop ends the choice at the very token plain decoding would end it
        on: the tokens after it are neither shown nor counted.
        """
        if event.finish_reason is FinishReason.ERROR:
            kind = {400: "invalid_request_error", 504: "timeout_error"}.get(event.error_status, "server_error")
            raise ApiError(event.error_status, event.error or "generation failed", kind, code=event.error_status)
        if event.progress is not None:
            self.num_cached_tokens = event.num_cached_tokens
            return ChoiceDelta(self.index, "", progress=event.progress)
        self._observe_timing(event)
        # a vision prompt's image markers were expanded into soft tokens below the API (U): count those
        self.num_prompt_tokens = max(self.num_prompt_tokens, event.num_prompt_tokens)
        self.num_drafted, self.num_draft_accepted = event.num_drafted, event.num_draft_accepted
        if len(event.token_ids) <= 1:
            return self._apply_one(event)
        deltas: list[ChoiceDelta] = []
        for i, token in enumerate(event.token_ids):
            is_last = i == len(event.token_ids) - 1
            part = replace(event, token_ids=(token,), logprobs=event.logprobs[i:i + 1] if event.logprobs else None,
                           finish_reason=event.finish_reason if is_last else None,
                           prompt_logprobs=event.prompt_logprobs if i == 0 else None)
            if (delta := self._apply_one(part)) is not None:
                deltas.append(delta)
            if self.finish_reason is not None:
                break
        return _merge_deltas(deltas)

    def _apply_one(self, event: TokenEvent) -> ChoiceDelta | None:
        self.token_ids.extend(event.token_ids)
        self.unsent_ids.extend(event.token_ids)
        self.num_cached_tokens = event.num_cached_tokens or self.num_cached_tokens
        step = self.assembler.push(event.token_ids)
        logprobs = self._logprob_texts(event)
        prompt = self._take_prompt_logprobs(event)
        text, stop, events = step.text, step.stop, ()
        if self.parser is not None:
            events, stop = self._parse(text, event.finish_reason)
            text = "".join(e.text for e in events if isinstance(e, ContentDelta))
        elif step.stop is not None:
            self.finish_reason = "stop"
        elif event.finish_reason is not None:
            text += self.assembler.finish()
            self.finish_reason = event.finish_reason.value  # "stop", "length", "abort" or "loop"
        self.text.append(text)
        self.logprobs.extend(logprobs)
        if not text and not events and not logprobs and prompt is None and self.finish_reason is None:
            return None
        token_ids, self.unsent_ids = tuple(self.unsent_ids), []
        return ChoiceDelta(self.index, text, logprobs, self.finish_reason, stop, token_ids, events,
                           prompt_logprobs=prompt)

    def _take_prompt_logprobs(self, event: TokenEvent) -> PromptLogprobs | None:
        if event.prompt_logprobs is None:
            return None
        tokenizer = self.ctx.tokenizer
        self.prompt_logprobs = tuple(
            PromptLogprobText(_entry(tokenizer, token_id, 0.0), None if lp is None else logprob_text(tokenizer, lp),
                              None if lp is None else lp.rank)
            for token_id, lp in zip(self.prompt_token_ids, event.prompt_logprobs))
        return self.prompt_logprobs

    def _parse(self, text: str, engine_reason: FinishReason | None) -> tuple[tuple[OutputEvent, ...], str | None]:
        """The parser's events for this step's text; ends the choice on its stop string or the engine's."""
        assert self.parser is not None
        parser = self.parser
        events = parser.feed(text)
        if parser.stop is None and engine_reason is not None:
            events += parser.feed(self.assembler.finish())
        if parser.stop is not None:
            self.finish_reason = "stop"
        elif engine_reason is not None:
            self.finish_reason = engine_reason.value
        if self.finish_reason is not None:
            events += parser.finish()
        return tuple(events), parser.stop

    def _observe_timing(self, event: TokenEvent) -> None:
        if not event.token_ids:
            return
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
            self.ctx.telemetry.observe_first_token(now - self.submitted_at)
        elif self.last_token_at is not None:
            self.ctx.telemetry.observe_inter_token((now - self.last_token_at) / len(event.token_ids))
        self.last_token_at = now

    def _logprob_texts(self, event: TokenEvent) -> tuple[LogprobText, ...]:
        if self.logprobs_n is None or not event.logprobs:
            return ()
        return tuple(logprob_text(self.ctx.tokenizer, lp) for lp in event.logprobs if lp.token_id not in self.hidden)

    def record(self) -> SequenceRecord:
        """What /metrics counts of this choice once its engine request ended."""
        timings = self._timings()
        return SequenceRecord(self.num_prompt_tokens - self.num_cached_tokens, self.num_cached_tokens,
                              timings.prefill_s, len(self.token_ids), timings.decode_s)

    def _timings(self) -> ChoiceTimings:
        return ChoiceTimings(self.submitted_at, self.first_token_at, self.last_token_at or time.monotonic())

    def snapshot(self) -> ChoiceResult:
        """The choice's prompt counts and timings so far, without text, tokens or reply: cheap enough
        for every chunk (timings_per_token), where a full result would copy and parse the whole output."""
        return ChoiceResult(self.index, self.prompt_index, "", (), (), self.finish_reason or "", None,
                            self.num_prompt_tokens, self.num_cached_tokens, self._timings(),
                            num_generated=len(self.token_ids), num_drafted=self.num_drafted,
                            num_draft_accepted=self.num_draft_accepted)

    def result(self) -> ChoiceResult:
        timings = self._timings()
        stop = self.parser.stop if self.parser is not None else self.assembler.stop
        reply = self.parser.result() if self.parser is not None else None
        return ChoiceResult(self.index, self.prompt_index, "".join(self.text), tuple(self.token_ids),
                            tuple(self.logprobs), self.finish_reason or "abort", stop,
                            self.num_prompt_tokens, self.num_cached_tokens, timings, reply,
                            num_drafted=self.num_drafted, num_draft_accepted=self.num_draft_accepted,
                            prompt_logprobs=self.prompt_logprobs)


def _merge_deltas(deltas: list[ChoiceDelta]) -> ChoiceDelta | None:
    """One delta for the per-token deltas of one multi-token event; finish and stop from the last."""
    if len(deltas) <= 1:
        return deltas[0] if deltas else None
    return replace(deltas[-1], text="".join(d.text for d in deltas),
                   logprobs=tuple(lp for d in deltas for lp in d.logprobs),
                   token_ids=tuple(t for d in deltas for t in d.token_ids),
                   events=_joined_text_events([e for d in deltas for e in d.events]),
                   prompt_logprobs=deltas[0].prompt_logprobs)


def _joined_text_events(events: list[OutputEvent]) -> tuple[OutputEvent, ...]:
    """Adjacent content (or reasoning) pieces as one, so a multi-token event (a committed diffusion
    block, accepted drafts) reaches the client as one delta per kind, not one per token."""
    joined: list[OutputEvent] = []
    for event in events:
        last = joined[-1] if joined else None
        if isinstance(event, (ContentDelta, ReasoningDelta)) and type(last) is type(event):
            joined[-1] = type(event)(last.text + event.text)  # type: ignore[union-attr]
        else:
            joined.append(event)
    return tuple(joined)


def failure_error(ctx: ApiContext, exc: Exception, request_id: str) -> ApiError:
    """Issue 44: the error one request's failure ends it with, in any protocol. An ApiError passes as it is
    (the generation counted it); any other exception is a bug in this request's path (detokenizer, logprobs,
    output parser, encoder): its traceback goes to the log with the request id, /metrics counts it, and the
    client gets a 500 in its protocol's shape while every other request keeps going."""
    if isinstance(exc, ApiError):
        return exc
    log.error("request %s failed: %r", request_id, exc, exc_info=exc)
    ctx.telemetry.record_failed_request("internal")
    return ApiError(500, INTERNAL_ERROR_MESSAGE, "server_error", code=500)


def logprob_text(tokenizer: Tokenizer, logprob: TokenLogprob) -> LogprobText:
    """A TokenLogprob with its token's text and bytes, and the same for its alternatives."""
    top = tuple(_entry(tokenizer, token_id, value) for token_id, value in logprob.top)
    return replace(_entry(tokenizer, logprob.token_id, logprob.logprob), top=top)


def _entry(tokenizer: Tokenizer, token_id: int, value: float) -> LogprobText:
    raw = tokenizer.token_bytes(token_id)
    # -inf is not JSON; clients expect a finite floor (OpenAI uses -9999.0).
    finite = value if value > -9999.0 else -9999.0
    return LogprobText(token_id, raw.decode("utf-8", errors="replace"), finite, tuple(raw))


class Generation:
    """The n-choice generation of one API call; close it (or finish iterating) to free the slots."""

    def __init__(self, ctx: ApiContext, choices: list[_Choice], request_id: str = "") -> None:
        self.ctx = ctx
        self.request_id = request_id  # the API call's id (its choices' engine requests are `<id>-<index>`)
        self._choices = choices
        self._is_closed = False

    @classmethod
    def start(cls, ctx: ApiContext, prompts: Sequence[Prompt], params: GenerationParams, *, n: int = 1,
              request_id: str) -> Generation:
        """Submit len(prompts) * n engine requests; choice index = prompt_index * n + j.

        Raises ApiError at once for a full queue (503), a prompt over the context (400) or a
        stopping engine (503); requests already submitted are then aborted.
        """
        _check_admissible(ctx, len(prompts) * n)
        lora_scales = _lora_scales(ctx, params.lora)
        choices: list[_Choice] = []
        try:
            for p, prompt in enumerate(prompts):
                for j in range(n):
                    index = p * n + j
                    stream = ctx.engine.submit(_engine_request(f"{request_id}-{index}", prompt, params, j,
                                                               lora_scales))
                    choices.append(_Choice(ctx, index, p, prompt, params, stream))
        except (EngineError, ValueError) as exc:
            for choice in choices:
                ctx.engine.abort(choice.stream.request_id)
            raise from_engine_error(exc) from None
        return cls(ctx, choices, request_id)

    async def stream(self) -> AsyncIterator[ChoiceDelta]:
        """Deltas of all choices as they come; each choice's last delta has its finish_reason."""
        queue: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()
        pumps = [asyncio.create_task(self._pump(choice, queue)) for choice in self._choices]
        try:
            remaining = len(pumps)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for pump in pumps:
                pump.cancel()
            await self.aclose()

    async def _pump(self, choice: _Choice, queue: asyncio.Queue[ChoiceDelta | BaseException | None]) -> None:
        try:
            async for event in choice.stream:
                delta = choice.apply(event)
                if delta is not None:
                    queue.put_nowait(delta)
                if choice.finish_reason is not None:
                    break
        except DecodeTimeoutError as exc:
            self.ctx.telemetry.record_failed_request("timeout")
            queue.put_nowait(ApiError(504, str(exc), "timeout_error", code=504))
        except ApiError as exc:  # the engine's error event
            self.ctx.telemetry.record_failed_request("timeout" if exc.status == 504 else "engine")
            queue.put_nowait(exc)
        except Exception as exc:  # noqa: BLE001 - issue 44: detokenizer, logprobs, parser: this request only
            queue.put_nowait(failure_error(self.ctx, exc, choice.stream.request_id))
        finally:
            await choice.stream.aclose()  # a stop string ended the text: abort the rest (no-op when done)
            self.ctx.telemetry.record_sequence(choice.record())
        queue.put_nowait(None)

    async def collect(self) -> list[ChoiceResult]:
        """Run every choice to its end; results in choice order."""
        async for _ in self.stream():
            pass
        return [choice.result() for choice in self._choices]

    def results(self) -> list[ChoiceResult]:
        """The choices as they stand (complete after `stream()` ended)."""
        return [choice.result() for choice in self._choices]

    def snapshot(self, index: int) -> ChoiceResult:
        """Choice `index`'s prompt counts and timings as they stand (llama-server timings_per_token)."""
        return self._choices[index].snapshot()

    def usage(self) -> Usage:
        """Prompt tokens count once per prompt (not per choice); completion tokens sum all choices."""
        firsts = {c.prompt_index: c for c in reversed(self._choices)}
        return Usage(prompt_tokens=sum(c.num_prompt_tokens for c in firsts.values()),
                     completion_tokens=sum(len(c.token_ids) for c in self._choices),
                     cached_tokens=sum(c.num_cached_tokens for c in firsts.values()))

    async def aclose(self) -> None:
        """Abort every choice still running (client gone, or the caller stopped early)."""
        if self._is_closed:
            return
        self._is_closed = True
        for choice in self._choices:
            with contextlib.suppress(Exception):
                await choice.stream.aclose()


def _check_admissible(ctx: ApiContext, num_requests: int) -> None:
    """400, not 503, for a call the engine could never hold at once: retrying cannot help."""
    limit = getattr(ctx.engine, "max_requests", None)  # scripted test engines have no bound
    if limit is not None and num_requests > limit:
        raise invalid_request(f"this request needs {num_requests} generations (prompts x n) but the server "
                              f"holds at most {limit} at once (--parallel + --max-queue-depth)")


def _lora_scales(ctx: ApiContext, entries: tuple[tuple[int, float], ...] | None) -> tuple[float, ...]:
    """One scale per loaded adapter: the request's `lora` list (llama-server: unnamed ids get 0), else
    the global scales (POST /lora-adapters); a bad id is a 400 naming it."""
    if entries is None:
        return ctx.lora.global_scales()
    try:
        return ctx.lora.resolve(entries)
    except ValueError as exc:
        raise invalid_request(str(exc)) from None


def _engine_request(request_id: str, prompt: Prompt, params: GenerationParams, choice_j: int,
                    lora_scales: tuple[float, ...] = ()) -> Request:
    sampling = params.sampling
    if sampling.seed is not None and choice_j:
        sampling = replace(sampling, seed=sampling.seed + choice_j)  # n > 1 with a seed: distinct samples
    processors = params.processors(prompt) if params.processors is not None else ()
    return Request(request_id, list(prompt.token_ids), sampling, priority=params.priority,
                   cache_prompt=params.cache_prompt, slot_id=params.slot_id, processors=processors,
                   lora_scales=lora_scales, report_progress=params.report_progress, images=prompt.images,
                   image_inputs=prompt.image_inputs)
