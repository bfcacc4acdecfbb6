"""Request memory admission (spec O) as pure arithmetic: blocks for prompt + planned output, the
pool as the default budget, MLXCEL_REQUEST_MEMORY_BUDGET only lowering it."""

from __future__ import annotations

import pytest

from mlxcel.engine.admission import MemoryBudget
from mlxcel.types import RequestMemoryError


def test_budget_defaults_to_the_pool_and_can_only_be_lowered() -> None:
    assert MemoryBudget.of(10, 16, 100).budget_bytes == 10 * 16 * 100
    assert MemoryBudget.of(10, 16, 100, lowered_to=1600).budget_bytes == 1600
    assert MemoryBudget.of(10, 16, 100, lowered_to=10**12).budget_bytes == 10 * 16 * 100  # never raised


def test_estimate_counts_whole_blocks_of_prompt_and_output() -> None:
    budget = MemoryBudget.of(4, 16, 10)  # 64 tokens
    assert budget.num_blocks(10, 6) == 1 and budget.num_blocks(10, 7) == 2
    assert budget.estimate_bytes(10, 7) == 2 * 16 * 10
    budget.check("fits", 60, 4)
    with pytest.raises(RequestMemoryError) as refused:
        budget.check("over", 60, 5)
    assert (refused.value.estimated_bytes, refused.value.budget_bytes) == (5 * 16 * 10, 640)


def test_sliding_window_caps_the_live_tokens() -> None:
    budget = MemoryBudget.of(4, 16, 10, max_live_tokens=64)
    budget.check("windowed", 1000, 1000)


def test_draft_kv_adds_to_the_estimate() -> None:
    budget = MemoryBudget(16, 10, 640, draft_bytes_per_token=10)
    budget.check("fits", 16, 16)
    with pytest.raises(RequestMemoryError):
        budget.check("draft pushes it over", 16, 17)
