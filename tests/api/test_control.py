"""F5 live-control registry (api/control.py): outcomes per id, every choice reached, handles
collected from the processors Generation.start makes, with real ReasoningBudget processors."""

from __future__ import annotations

import torch

from mlxcel.api.control import CompletionControls, ControlOutcome, collect_handles
from mlxcel.api.generation import GenerationParams, Prompt
from mlxcel.chat.budget import UNLIMITED, ReasoningBudget
from mlxcel.chat.loop_guard import STANDARD, LoopGuard
from mlxcel.chat.reasoning import ThinkTokens

THINK = ThinkTokens("<think>", "</think>", (3,), (7,))


def budget(*, reasoning: bool = True) -> ReasoningBudget:
    processor = ReasoningBudget(THINK, UNLIMITED, starts_in_reasoning=True)
    if not reasoning:
        processor.accept(7)  # the reply closed its block
    return processor


def forces_end(processor: ReasoningBudget) -> bool:
    """Whether the processor's next step leaves only the end marker possible."""
    logits = torch.zeros(10)
    processor.process(logits, [])
    return bool(torch.isinf(logits).sum() == 9 and logits[7] == 0.0)


def test_f5_unknown_id_and_unregistered_completion() -> None:
    controls = CompletionControls()
    assert controls.end_reasoning("chatcmpl-none") is ControlOutcome.UNKNOWN
    controls.register("chatcmpl-1", [budget()], is_opted_in=True)
    assert controls.is_running("chatcmpl-1")
    controls.unregister("chatcmpl-1")
    controls.unregister("chatcmpl-1")  # idempotent: the stream's end and on_close both call it
    assert controls.end_reasoning("chatcmpl-1") is ControlOutcome.UNKNOWN


def test_f5_not_opted_in_leaves_the_processors_alone() -> None:
    controls = CompletionControls()
    processor = budget()
    controls.register("chatcmpl-1", [processor], is_opted_in=False)
    assert controls.end_reasoning("chatcmpl-1") is ControlOutcome.NOT_OPTED_IN
    assert not forces_end(processor)


def test_f5_every_choice_is_told_and_any_still_reasoning_means_ending() -> None:
    controls = CompletionControls()
    done, running, also_running = budget(reasoning=False), budget(), budget()
    assert not forces_end(running)
    controls.register("chatcmpl-1", [done, running, also_running], is_opted_in=True)
    assert controls.end_reasoning("chatcmpl-1") is ControlOutcome.ENDING
    assert forces_end(running) and forces_end(also_running)


def test_f5_all_choices_past_their_reasoning_is_already_ended() -> None:
    controls = CompletionControls()
    controls.register("chatcmpl-1", [budget(reasoning=False), budget(reasoning=False)], is_opted_in=True)
    assert controls.end_reasoning("chatcmpl-1") is ControlOutcome.ALREADY_ENDED


def test_f5_collect_handles_keeps_only_controllable_processors_per_choice() -> None:
    made: list[tuple[object, ...]] = []

    def processors(prompt: Prompt) -> tuple[ReasoningBudget | LoopGuard, ...]:
        found = (budget(), LoopGuard(STANDARD))
        made.append(found)
        return found

    params, handles = collect_handles(GenerationParams(processors=processors))
    assert handles == []  # filled as the choices' requests are made
    assert params.processors is not None
    for _ in range(2):  # two choices
        params.processors(Prompt((1, 2)))
    assert handles == [made[0][0], made[1][0]]


def test_f5_collect_handles_without_processors_is_a_no_op() -> None:
    params = GenerationParams()
    same, handles = collect_handles(params)
    assert same is params and handles == []
