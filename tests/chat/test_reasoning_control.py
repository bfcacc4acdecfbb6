"""F5 live control at the processor: `ReasoningBudget.end_reasoning()` forces the end marker from
the next step on, budget or not, through the real sampler (tests/chat/drive.py)."""

from __future__ import annotations

import threading

import torch

from mlxcel.chat.budget import UNLIMITED, ReasoningBudget, make_budget_processor
from mlxcel.chat.reasoning import ThinkTokens
from tests.chat.drive import drive, single_thread  # noqa: F401 - autouse fixture

THINK = ThinkTokens("<think>", "</think>", (3,), (7, 8))  # a two-token end marker
VOCAB = 32


def never_closes(logits: torch.Tensor, output: list[int]) -> None:
    """A model that opens its reasoning and never writes any end-marker token itself."""
    logits[[7, 8]] = -1e9
    if not output:
        logits[3] = 1e9


def test_f5_controlled_request_gets_a_processor_even_without_a_budget() -> None:
    assert make_budget_processor(THINK, UNLIMITED, starts_in_reasoning=False) is None
    made = make_budget_processor(THINK, UNLIMITED, starts_in_reasoning=False, is_controlled=True)
    assert isinstance(made, ReasoningBudget) and made.budget == UNLIMITED
    assert make_budget_processor(None, UNLIMITED, starts_in_reasoning=False, is_controlled=True) is None


def test_f5_unlimited_processor_never_forces_by_itself() -> None:
    processor = ReasoningBudget(THINK, UNLIMITED, starts_in_reasoning=False)
    tokens, _ = drive([processor], VOCAB, seed=0, max_steps=60, steer=never_closes)
    assert 7 not in tokens and processor.num_reasoning_tokens == 59


def test_f5_end_reasoning_forces_the_marker_token_by_token_at_the_next_step() -> None:
    processor = ReasoningBudget(THINK, UNLIMITED, starts_in_reasoning=False)
    answers: list[bool] = []

    def steer(logits: torch.Tensor, output: list[int]) -> None:
        never_closes(logits, output)
        if len(output) == 6:  # like the control route: from another thread, mid-generation
            caller = threading.Thread(target=lambda: answers.append(processor.end_reasoning()))
            caller.start()
            caller.join()

    tokens, _ = drive([processor], VOCAB, seed=1, max_steps=12, steer=steer)
    assert answers == [True]  # it was still reasoning
    assert tokens[6:8] == [7, 8] and 7 not in tokens[:6]
    assert processor.end_reasoning() is False  # the block is closed: nothing left to end


def test_f5_end_requested_before_the_block_opens_closes_it_at_once() -> None:
    processor = ReasoningBudget(THINK, UNLIMITED, starts_in_reasoning=False)
    assert processor.end_reasoning() is True  # nothing generated yet: the block may still open
    tokens, _ = drive([processor], VOCAB, seed=2, max_steps=4, steer=never_closes)
    assert tokens[:3] == [3, 7, 8]


def test_f5_end_reasoning_also_cuts_a_budget_short() -> None:
    processor = ReasoningBudget(THINK, 50, starts_in_reasoning=True)
    processor.end_reasoning()
    tokens, _ = drive([processor], VOCAB, seed=3, max_steps=3, steer=never_closes)
    assert tokens[:2] == [7, 8]
