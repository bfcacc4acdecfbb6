"""Two engines over one model (the tests' `engine_like`: a second engine without a second load)
run its layers on two threads: the per-step memos of rope and of fused projections must never
hand one thread the other's answer (a CI failure: a 1-row decode step got a 5-row rope table)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from mlxcel.layers.quant import FusedOutput, FusedQuantLinear
from mlxcel.layers.rope import RotaryEmbedding


@pytest.fixture()
def frequent_thread_switches() -> Iterator[None]:
    """Switch threads every microsecond, so a torn two-part memo write is hit within the test."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def race(work: Callable[[int], None], rounds: int = 3000) -> list[BaseException]:
    """Run `work(rows)` `rounds` times on two threads at once (1 row and 5 rows); return what failed."""
    failures: list[BaseException] = []

    def loop(rows: int) -> None:
        try:
            for _ in range(rounds):
                work(rows)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            failures.append(error)

    threads = [threading.Thread(target=loop, args=(rows,)) for rows in (1, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return failures


def test_rope_memo_answers_each_thread_for_its_own_positions(frequent_thread_switches: None) -> None:
    rope = RotaryEmbedding(16, 10000.0, max_positions=64)

    def work(rows: int) -> None:
        positions = torch.arange(rows)  # a new tensor each step, asked for by two "layers"
        for _ in range(2):
            cos, sin = rope.cos_sin(positions, torch.float32)
            assert cos.shape[0] == sin.shape[0] == rows, (rows, cos.shape, sin.shape)

    assert race(work) == []


def test_fused_projection_memo_answers_each_thread_for_its_own_input(frequent_thread_switches: None) -> None:
    torch.manual_seed(0)
    fused = FusedQuantLinear.of([nn.Linear(32, 16, bias=False), nn.Linear(32, 8, bias=False)], quantized=False)
    first, second = FusedOutput(fused, 0), FusedOutput(fused, 1)

    def work(rows: int) -> None:
        x = torch.randn(rows, 32)
        assert first(x).shape == (rows, 16) and second(x).shape == (rows, 8)

    assert race(work) == []
