"""A stand-in for the engine loop: random logits through the real sampler and token processors.

`drive` does per step what the engine does per row: the sampler (engine/sampler.py) calls each
processor's `process` on the logits row, picks a token, then every processor `accept`s it
(engine/scheduler.py `_check_finish`), and a non-None FinishReason ends the request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from mlxcel.engine.sampler import SamplingRow, make_generator, sample
from mlxcel.types import FinishReason, SamplingParams, TokenProcessor

Steer = Callable[[torch.Tensor, list[int]], None]


def drive(
    processors: Sequence[TokenProcessor],
    vocab_size: int,
    *,
    seed: int,
    max_steps: int = 400,
    eos_token_ids: frozenset[int] = frozenset(),
    steer: Steer | None = None,
    temperature: float = 1.0,
) -> tuple[list[int], FinishReason]:
    """Generate with random logits (optionally steered, like a scripted model) until a
    processor or an EOS token ends it; returns the tokens and the finish reason."""
    torch.manual_seed(seed)
    params = SamplingParams(temperature=temperature, seed=seed)
    generator = make_generator(seed)
    output: list[int] = []
    for _ in range(max_steps):
        logits = torch.randn(1, vocab_size, generator=generator) * 3
        if steer is not None:
            steer(logits[0], output)
        row = SamplingRow(params, list(output), len(output), eos_token_ids, generator, tuple(processors))
        tokens, _ = sample(logits, [row])
        token = tokens[0]
        output.append(token)
        for processor in processors:
            reason = processor.accept(token)
            if reason is not None:
                return output, reason
        if token in eos_token_ids:
            return output, FinishReason.STOP
    return output, FinishReason.LENGTH


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Small per-step tensor ops on a shared 2-core machine run far faster on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="module")
def single_thread() -> Iterator[None]:
    """Import into a test module (`from tests.chat.drive import single_thread`) to use it."""
    with one_torch_thread():
        yield
