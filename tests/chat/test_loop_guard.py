"""Loop detection (P): the n-gram repeat guard, its three policy layers and its errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mlxcel.chat.loop_guard import (
    OFF, STANDARD, LoopGuard, LoopGuardError, LoopPolicy, family_policy, make_loop_guard, parse_operator_override,
    resolve_loop_policy,
)  # fmt: skip
from mlxcel.types import FinishReason
from tests.chat.drive import drive, single_thread  # noqa: F401 - autouse fixture
from tests.chat.wire import chat_options


def feed(guard: LoopGuard, tokens: list[int]) -> list[FinishReason | None]:
    return [guard.accept(t) for t in tokens]


def test_p_single_token_loop_ends_on_the_min_count_th_repeat() -> None:
    reasons = feed(LoopGuard(LoopPolicy(20, 1, 4)), [5, 6, 9, 9, 9, 9, 9])
    assert reasons == [None] * 5 + [FinishReason.LOOP, FinishReason.LOOP]


def test_p_block_loop_is_detected_and_shorter_repeats_are_not() -> None:
    guard = LoopGuard(LoopPolicy(max_pattern_size=3, min_pattern_size=2, min_count=3))
    assert feed(guard, [1, 2, 1, 2, 7, 7, 7]) == [None] * 7  # 2x "1 2" and 3x "7" (below min size 2)
    assert feed(guard, [3, 4, 5, 3, 4, 5, 3, 4])[-1] is None
    assert guard.accept(5) is FinishReason.LOOP


def test_p_pattern_longer_than_max_is_not_a_loop() -> None:
    guard = LoopGuard(LoopPolicy(max_pattern_size=2, min_pattern_size=1, min_count=2))
    assert feed(guard, [1, 2, 3, 1, 2, 3]) == [None] * 6


def test_p_a_looping_generation_ends_early_through_the_sampler() -> None:
    """A degenerate 'model' that strongly prefers repeating the last-but-two token."""
    def steer(logits: torch.Tensor, output: list[int]) -> None:
        if len(output) >= 3:
            logits[output[-3]] += 50.0

    guard = LoopGuard(STANDARD)
    tokens, reason = drive([guard], 64, seed=0, max_steps=200, steer=steer)
    assert reason is FinishReason.LOOP
    assert len(tokens) < 30


def test_p_family_defaults() -> None:
    assert family_policy("gemma4") == STANDARD == LoopPolicy(20, 1, 4)
    assert family_policy("gemma4_text").is_enabled
    assert not family_policy("llama").is_enabled and not family_policy("gemma3").is_enabled


@pytest.mark.parametrize(("text", "expected"), [
    (None, {}),
    ("", {}),
    ("off", {"max_pattern_size": 0}),
    ("0", {"max_pattern_size": 0}),
    ("on", {"max_pattern_size": 20, "min_pattern_size": 1, "min_count": 4}),
    ("max=8,count=6", {"max_pattern_size": 8, "min_pattern_size": 1, "min_count": 6}),
    ("max_pattern_size=10, min_pattern_size=2, min_count=3",
     {"max_pattern_size": 10, "min_pattern_size": 2, "min_count": 3}),
])  # fmt: skip
def test_p_operator_override_format(text: str | None, expected: dict[str, int]) -> None:
    assert parse_operator_override(text) == expected


@pytest.mark.parametrize("text", ["sometimes", "max=eight", "width=3", "min=5,max=2", "count=1"])
def test_p_bad_operator_override_refuses_startup(text: str) -> None:
    with pytest.raises(LoopGuardError, match="MLXCEL_LOOP_DETECTION"):
        parse_operator_override(text)


@pytest.mark.parametrize(("family", "operator", "request_body", "expected"), [
    (STANDARD, {}, {}, STANDARD),
    (OFF, {}, {}, OFF),
    (STANDARD, {}, {"max_pattern_size": 0}, LoopPolicy(0, 1, 4)),  # the request turns Gemma 4's guard off
    (OFF, {"max_pattern_size": 20}, {}, STANDARD),  # operator forces it on
    (STANDARD, {"max_pattern_size": 0}, {"min_count": 6}, LoopPolicy(20, 1, 6)),  # request opts back in
    (OFF, {}, {"max_pattern_size": 8}, LoopPolicy(8, 1, 4)),  # opt-in: other fields standard
    (OFF, {}, {"extra_body": {"min_count": 3}}, LoopPolicy(20, 1, 3)),
    (STANDARD, {"min_count": 5}, {"min_pattern_size": 2}, LoopPolicy(20, 2, 5)),
])  # fmt: skip
def test_p_request_fields_override_operator_override_family_per_field(
    family: LoopPolicy, operator: dict[str, int], request_body: dict[str, Any], expected: LoopPolicy
) -> None:
    assert resolve_loop_policy(family, operator, chat_options(request_body).loop_overrides) == expected


@pytest.mark.parametrize(("request_body", "message"), [
    ({"min_count": 1}, "min_count must be at least 2"),
    ({"max_pattern_size": 3, "min_pattern_size": 4}, r"min_pattern_size \(4\) must not exceed max_pattern_size \(3\)"),
    ({"max_pattern_size": -1}, "max_pattern_size must be 0"),
    ({"min_count": "4"}, "min_count must be an integer"),
])  # fmt: skip
def test_p_bad_request_fields_are_400s(request_body: dict[str, Any], message: str) -> None:
    with pytest.raises(LoopGuardError, match=message):
        resolve_loop_policy(STANDARD, {}, chat_options(request_body).loop_overrides)


def test_p_off_policy_makes_no_processor() -> None:
    assert make_loop_guard(OFF) is None
    assert isinstance(make_loop_guard(STANDARD), LoopGuard)
