"""Reasoning budget (spec R): close the `<think>` block after N reasoning tokens.

Semantics follow llama.cpp's --reasoning-budget and vLLM's thinking_token_budget:
-1 unlimited, 0 close at once, N > 0 force the end marker after N reasoning tokens (the
opening marker is not counted). A multi-token end marker is forced one token per step. The
forced tokens are ordinary sampled tokens: they stream as text deltas like any other.

Where the budget comes from, highest first: the request (`ChatOptions.reasoning_budget`, which
its adapter read from its own fields and checked with `check_request_budget`),
`--reasoning-budget`, `LLAMA_ARG_REASONING_BUDGET`, else -1.

The same processor carries live control (F5, llama-server's `reasoning_control`): a request that
opts in gets one even without a budget, and `end_reasoning()`, called from any thread, makes it
force the end marker from the next step on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from mlxcel.chat.reasoning import ThinkTokens, ThinkTracker
from mlxcel.types import FinishReason

log = logging.getLogger(__name__)

UNLIMITED = -1


class BudgetError(ValueError):
    """A request's reasoning budget is invalid; the message is fit for a 400 reply."""


def check_request_budget(field: str, value: Any, max_tokens: int | None) -> int:
    """A request's budget given in `field` (named in the message); `max_tokens` is the
    request's (n_predict on /completion), None when it gave none. Raises BudgetError for a
    value that is not an integer, below -1, or above max_tokens."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise BudgetError(f"{field} must be an integer (-1 for unlimited), not {value!r}")
    if value < UNLIMITED:
        raise BudgetError(f"{field} must be -1 (unlimited), 0 or a positive number of tokens, not {value}")
    if value > 0 and max_tokens is not None and value > max_tokens:
        raise BudgetError(f"{field} ({value}) must not exceed max_tokens ({max_tokens})")
    return value


def resolve_thinking_budget(requested: int | None, server_default: int) -> int:
    """The reasoning budget for one request: its own (already checked), else the server's."""
    return server_default if requested is None else requested


def parse_server_budget(value: int | str | None) -> int:
    """--reasoning-budget / LLAMA_ARG_REASONING_BUDGET: -1 or more; a ValueError otherwise."""
    if value is None or value == "":
        return UNLIMITED
    try:
        budget = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"--reasoning-budget must be an integer, not {value!r}") from None
    if budget < UNLIMITED:
        raise ValueError(f"--reasoning-budget must be -1 (unlimited) or more, not {budget}")
    return budget


def warn_if_unsupported(budget: int, think: ThinkTokens | None) -> None:
    """Logged once at model load: a budget is set but the model has no reasoning markers."""
    if budget != UNLIMITED and think is None:
        log.warning("--reasoning-budget %d is ignored: the tokenizer has no <think>/</think> tokens", budget)


class ReasoningBudget:
    """A TokenProcessor that forces the end marker once the block has used its budget, or once
    `end_reasoning()` asked for it (budget UNLIMITED: only then)."""

    def __init__(self, think: ThinkTokens, budget: int, *, starts_in_reasoning: bool) -> None:
        if budget < UNLIMITED:
            raise ValueError(f"a reasoning budget processor needs a budget of -1 (unlimited) or more, not {budget}")
        self.budget = budget
        self._tracker = ThinkTracker(think, starts_in_reasoning=starts_in_reasoning)
        self._is_forcing = False
        # Set from the event-loop thread, read by the engine thread in process(): a flag, no lock.
        self._end_requested = threading.Event()
        self.is_controlled = False  # reasoning_control: its flag is set in this process only

    def __getstate__(self) -> dict:
        """A copy for the engine process (issue 25): the budget crosses, live control cannot."""
        if self.is_controlled:
            raise TypeError("reasoning_control cannot reach a model in another process (--engine-process on)")
        return {"budget": self.budget, "_tracker": self._tracker, "_is_forcing": self._is_forcing,
                "is_controlled": False, "_end_requested": self._end_requested.is_set()}

    def __setstate__(self, state: dict) -> None:
        requested = state.pop("_end_requested")
        self.__dict__.update(state)
        self._end_requested = threading.Event()
        if requested:
            self._end_requested.set()

    @property
    def num_reasoning_tokens(self) -> int:
        return self._tracker.num_reasoning_tokens

    def end_reasoning(self) -> bool:
        """Force the end marker from the next step on (thread-safe). True when the reply has not
        left its reasoning block yet (it is inside it, or may still open it)."""
        self._end_requested.set()
        return self._tracker.phase != ThinkTracker.AFTER

    def process(self, logits: torch.Tensor, output_ids: Sequence[int]) -> None:
        tracker = self._tracker
        if tracker.phase != ThinkTracker.REASONING:
            return
        if self._is_forcing or self._is_spent() or self._end_requested.is_set():
            self._is_forcing = True
            force_token(logits, tracker.next_end_token)

    def _is_spent(self) -> bool:
        return self.budget != UNLIMITED and self._tracker.num_reasoning_tokens >= self.budget

    def accept(self, token_id: int) -> FinishReason | None:
        self._tracker.advance(token_id)
        return None


def force_token(logits: torch.Tensor, token_id: int) -> None:
    """Leave only `token_id` possible in one logits row (in place)."""
    logits.fill_(float("-inf"))
    if 0 <= token_id < logits.shape[-1]:
        logits[token_id] = 0.0


def make_budget_processor(
    think: ThinkTokens | None, budget: int, *, starts_in_reasoning: bool, is_controlled: bool = False
) -> ReasoningBudget | None:
    """The processor for a request's budget; None when the model cannot think, or when the
    budget is unlimited and the request did not opt in to live control (`is_controlled`)."""
    if think is None or (budget == UNLIMITED and not is_controlled):
        return None
    processor = ReasoningBudget(think, budget, starts_in_reasoning=starts_in_reasoning)
    processor.is_controlled = is_controlled
    return processor
