"""Injected faults for issue 44's tests, installed in a test server process (`install()` before it starts).

A request chooses its fault with its `top_k` (greedy requests ignore top_k, so it changes nothing else):
the fault fires at the named stage of that request's path once it produced two tokens. Two encoder faults
are chosen by what the encoder sees: chat's logprobs with 7 alternatives, an Anthropic usage of 11 tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

FAULT_TOP_K = {"engine step": 31, "sampler": 32, "detokenization": 33, "logprobs": 34, "output parser": 35,
               "hand-over": 36}
ENCODER_TOP_LOGPROBS = 7  # chat's logprobs encoder fails for an entry with this many alternatives
ENCODER_NUM_TOKENS = 11  # Anthropic's usage encoder fails for this many output tokens
AFTER_TOKENS = 2
_STAGES = {top_k: stage for stage, top_k in FAULT_TOP_K.items()}
_marked: dict[str, str] = {}  # engine request id -> the stage its fault fires at


class InjectedFault(RuntimeError):
    pass


class FailingAccept:
    """The engine step's fault: taking the request's third token raises (a per-request processor)."""

    def __init__(self) -> None:
        self.num_accepted = 0

    def process(self, logits: torch.Tensor, output_ids: Sequence[int]) -> None:
        return None

    def accept(self, token_id: int) -> None:
        self.num_accepted += 1
        if self.num_accepted > AFTER_TOKENS:
            raise InjectedFault("injected fault: engine step")


def install() -> None:
    """Patch the real components so each fault fires for the requests that chose it, and only those."""
    _mark_requests()
    _fail_sampler()
    _fail_choice_parts()
    _fail_hand_over()
    _fail_encoders()


def _mark_requests() -> None:
    from mlxcel.engine.client import EngineClient

    submit = EngineClient.submit

    def marking_submit(self: EngineClient, request: Any) -> Any:
        stage = _STAGES.get(request.sampling.top_k)
        if stage is not None:
            _marked[request.request_id] = stage
            if stage == "engine step":
                request.processors = (*request.processors, FailingAccept())
        return submit(self, request)

    EngineClient.submit = marking_submit  # type: ignore[method-assign]


def _fail_sampler() -> None:
    from mlxcel.engine import loop

    sample = loop.sample

    def failing_sample(logits: torch.Tensor, rows: list[Any], counts: Any = None) -> Any:
        if any(_STAGES.get(row.params.top_k) == "sampler" and row.num_generated >= AFTER_TOKENS for row in rows):
            raise InjectedFault("injected fault: sampler")
        return sample(logits, rows, counts)

    loop.sample = failing_sample


def _after(calls: int, fn: Callable[..., Any], stage: str) -> Callable[..., Any]:
    """`fn` that raises from its (calls + 1)-th call on."""
    count = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        if count[0] > calls:
            raise InjectedFault(f"injected fault: {stage}")
        return fn(*args, **kwargs)

    return wrapped


def _fail_choice_parts() -> None:
    """Detokenizer, logprobs and output parser of the marked choice raise (the instance's own method)."""
    from mlxcel.api import generation

    init = generation._Choice.__init__

    def failing_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        stage = _marked.get(self.stream.request_id)
        if stage == "detokenization":
            self.assembler.push = _after(AFTER_TOKENS, self.assembler.push, stage)
        elif stage == "logprobs":
            self._logprob_texts = _after(AFTER_TOKENS, self._logprob_texts, stage)
        elif stage == "output parser" and self.parser is not None:
            self.parser.feed = _after(AFTER_TOKENS, self.parser.feed, stage)

    generation._Choice.__init__ = failing_init  # type: ignore[method-assign]


def _fail_hand_over() -> None:
    """The engine-to-API hand-over of the marked request's events: the engine thread's sink (one process)
    and the API process's reader of the engine process's events (`--engine-process on`)."""
    from mlxcel.engine.client import Mailbox
    from mlxcel.engine.remote import RemoteCore

    counts: dict[str, int] = {}

    def should_fail(event: Any) -> bool:
        if _marked.get(event.request_id) != "hand-over" or not event.token_ids:
            return False
        counts[event.request_id] = counts.get(event.request_id, 0) + 1
        return counts[event.request_id] > AFTER_TOKENS

    post, deliver_one = Mailbox.post, RemoteCore._deliver_one

    def failing_post(self: Mailbox, queue: Any, event: Any) -> None:
        if should_fail(event):
            raise InjectedFault("injected fault: hand-over (engine thread)")
        post(self, queue, event)

    def failing_deliver_one(self: RemoteCore, event: Any) -> None:
        if should_fail(event):
            raise InjectedFault("injected fault: hand-over (engine process reader)")
        deliver_one(self, event)

    Mailbox.post = failing_post  # type: ignore[method-assign]
    RemoteCore._deliver_one = failing_deliver_one  # type: ignore[method-assign]


def _fail_encoders() -> None:
    from mlxcel.api.anthropic import messages
    from mlxcel.api.openai import chat

    logprobs_json, usage_json = chat.logprobs_json, messages.usage_json

    def failing_logprobs_json(entries: Sequence[Any]) -> Any:
        if any(len(e.top) == ENCODER_TOP_LOGPROBS for e in entries):
            raise InjectedFault("injected fault: chat logprobs encoder")
        return logprobs_json(entries)

    def failing_usage_json(usage: Any) -> Any:
        if usage.completion_tokens == ENCODER_NUM_TOKENS:
            raise InjectedFault("injected fault: Anthropic usage encoder")
        return usage_json(usage)

    chat.logprobs_json = failing_logprobs_json
    messages.usage_json = failing_usage_json
