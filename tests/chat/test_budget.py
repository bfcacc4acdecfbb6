"""Reasoning budget (R): field precedence and 400s, and `</think>` forced after N tokens.

The processor is driven through the real sampler by random logits standing in for a thinking
model (SmolLM2's vocabulary plus `<think>`/`</think>` special tokens) that never closes its
reasoning by itself: only the budget can close it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mlxcel.chat.budget import (
    UNLIMITED, BudgetError, ReasoningBudget, make_budget_processor, parse_server_budget, resolve_thinking_budget,
)  # fmt: skip
from mlxcel.chat.output import ChatOutputParser
from mlxcel.chat.events import ContentDelta, ReasoningDelta
from mlxcel.text.output import TextAssembler
from mlxcel.chat.reasoning import ThinkTokens, infer_think_tokens
from mlxcel.text.tokenizer import Tokenizer
from tests.chat.drive import drive, single_thread  # noqa: F401 - autouse fixture
from tests.chat.wire import chat_options


@pytest.fixture(scope="module")
def thinking_tokenizer(smollm2_metadata: dict[str, Any]) -> Tokenizer:
    """SmolLM2's tokenizer with `<think>` and `</think>` added as special tokens."""
    tokenizer = Tokenizer.from_gguf(smollm2_metadata)
    tokenizer.backend.add_special_tokens(["<think>", "</think>"])
    return tokenizer


@pytest.fixture(scope="module")
def think(thinking_tokenizer: Tokenizer) -> ThinkTokens:
    found = infer_think_tokens(thinking_tokenizer)
    assert found is not None
    return found


def never_closes(think: ThinkTokens, *, opens: bool) -> Any:
    """A scripted model: opens with <think> (when `opens`) and never writes </think> itself."""
    def steer(logits: torch.Tensor, output: list[int]) -> None:
        logits[list(think.end_ids)] = -1e9
        if opens and not output:
            logits[think.start_ids[0]] = 1e9
    return steer


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0, 1, 7, 30])
def test_r_budget_forces_the_end_marker_after_n_reasoning_tokens(
    thinking_tokenizer: Tokenizer, think: ThinkTokens, budget: int
) -> None:
    processor = ReasoningBudget(think, budget, starts_in_reasoning=False)
    tokens, _ = drive([processor], thinking_tokenizer.vocab_size, seed=budget, max_steps=budget + 6,
                      steer=never_closes(think, opens=True))
    start, end = think.start_ids[0], think.end_ids[0]
    assert tokens[0] == start
    assert tokens.index(end) == 1 + budget  # the opening tag is not counted
    assert processor.num_reasoning_tokens == budget


@pytest.mark.slow
def test_r_primed_prompt_with_budget_zero_closes_at_once(thinking_tokenizer: Tokenizer, think: ThinkTokens) -> None:
    processor = ReasoningBudget(think, 0, starts_in_reasoning=True)
    tokens, _ = drive([processor], thinking_tokenizer.vocab_size, seed=1, max_steps=3,
                      steer=never_closes(think, opens=False))
    assert tokens[0] == think.end_ids[0]


@pytest.mark.slow
def test_r_forced_end_marker_streams_as_an_ordinary_delta(thinking_tokenizer: Tokenizer, think: ThinkTokens) -> None:
    """Through the TextAssembler and ChatOutputParser the forced `</think>` splits the text
    like one the model wrote: N tokens of reasoning, then content."""
    processor = ReasoningBudget(think, 5, starts_in_reasoning=True)
    tokens, _ = drive([processor], thinking_tokenizer.vocab_size, seed=3, max_steps=12,
                      steer=never_closes(think, opens=False))
    assembler = TextAssembler(thinking_tokenizer, hidden_token_ids=())
    parser = ChatOutputParser(think=think, starts_in_reasoning=True)
    events = [e for t in tokens for e in parser.feed(assembler.push([t]).text)]
    events += parser.feed(assembler.finish()) + parser.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    assert reasoning == thinking_tokenizer.decode(tokens[:5]).strip()
    assert any(isinstance(e, ContentDelta) for e in events)


def test_r_multi_token_end_marker_is_forced_token_by_token() -> None:
    think = ThinkTokens("<a>", "</a>", (5,), (7, 8, 9))
    processor = ReasoningBudget(think, 2, starts_in_reasoning=True)

    def steer(logits: torch.Tensor, output: list[int]) -> None:
        logits[[7, 8, 9]] = -1e9

    tokens, _ = drive([processor], 32, seed=0, max_steps=8, steer=steer)
    assert tokens[2:5] == [7, 8, 9]
    assert 7 not in tokens[:2]


def test_r_unlimited_or_no_markers_means_no_processor() -> None:
    think = ThinkTokens("<think>", "</think>", (1,), (2,))
    assert make_budget_processor(think, UNLIMITED, starts_in_reasoning=False) is None
    assert make_budget_processor(None, 10, starts_in_reasoning=False) is None
    assert isinstance(make_budget_processor(think, 0, starts_in_reasoning=False), ReasoningBudget)


@pytest.mark.parametrize(("body", "server", "max_tokens", "expected"), [
    ({}, UNLIMITED, 100, UNLIMITED),
    ({}, 64, 100, 64),
    ({"thinking_budget_tokens": -1}, 64, 100, UNLIMITED),  # the request lifts the server's limit
    ({"thinking_budget_tokens": 8, "thinking_token_budget": 9, "thinking_budget": 10}, -1, 100, 8),
    ({"thinking_token_budget": 9, "thinking_budget": 10}, -1, 100, 9),
    ({"thinking_budget": 10}, -1, 100, 10),
    ({"extra_body": {"thinking_budget_tokens": 12}}, -1, 100, 12),
    ({"thinking_budget_tokens": None, "thinking_budget": 3}, -1, 100, 3),
    ({"thinking_budget_tokens": 0}, 64, 1, 0),
    ({"thinking_budget_tokens": 500}, -1, None, 500),
])  # fmt: skip
def test_r_budget_field_precedence(body: dict[str, Any], server: int, max_tokens: int | None, expected: int) -> None:
    assert resolve_thinking_budget(chat_options(body, max_tokens=max_tokens).reasoning_budget, server) == expected


@pytest.mark.parametrize(("body", "message"), [
    ({"thinking_budget_tokens": 101}, r"thinking_budget_tokens \(101\) must not exceed max_tokens \(100\)"),
    ({"thinking_budget": 101}, r"thinking_budget \(101\) must not exceed max_tokens"),
    ({"thinking_budget_tokens": -2}, "must be -1 \\(unlimited\\), 0 or a positive number of tokens, not -2"),
    ({"thinking_token_budget": "8"}, "thinking_token_budget must be an integer"),
    ({"thinking_budget_tokens": True}, "must be an integer"),
])  # fmt: skip
def test_r_invalid_budgets_are_400s(body: dict[str, Any], message: str) -> None:
    with pytest.raises(BudgetError, match=message):
        resolve_thinking_budget(chat_options(body, max_tokens=100).reasoning_budget, UNLIMITED)


def test_r_server_budget_flag() -> None:
    assert parse_server_budget(None) == UNLIMITED
    assert parse_server_budget("256") == 256
    with pytest.raises(ValueError, match="--reasoning-budget must be -1"):
        parse_server_budget(-5)
    with pytest.raises(ValueError, match="must be an integer"):
        parse_server_budget("lots")


def test_issue25_a_budget_crosses_to_the_engine_process_and_live_control_does_not(think: ThinkTokens) -> None:
    """--engine-process on pickles each request's processors: a budget keeps its state; a controlled
    one (reasoning_control, whose flag is set in the API process) refuses, so the request is a 400."""
    import pickle

    budget = make_budget_processor(think, 3, starts_in_reasoning=True)
    assert budget is not None
    budget.accept(5)
    copy = pickle.loads(pickle.dumps(budget))
    assert copy.budget == 3 and copy.num_reasoning_tokens == budget.num_reasoning_tokens == 1
    controlled = make_budget_processor(think, UNLIMITED, starts_in_reasoning=True, is_controlled=True)
    with pytest.raises(TypeError, match="reasoning_control"):
        pickle.dumps(controlled)
