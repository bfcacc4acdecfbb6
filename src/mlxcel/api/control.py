"""Live control of running completions (F5): the registry behind llama-server's
`POST /v1/chat/completions/control`.

Protocol-neutral: an adapter registers each completion under its id while it runs, with the
control handles of its choices' token processors, and removes it when it ends; a control route
looks the id up and acts on every choice (n > 1 included). Handles only set thread-safe flags
that the engine thread reads on its next step; nothing here touches engine state.

    params, handles = collect_handles(params)            # before Generation.start (opted in)
    generation = Generation.start(ctx, prompts, params, ...)   # fills `handles`, one per choice
    ctx.controls.register(completion_id, handles, is_opted_in=True)
    ...                                                    # the control route:
    outcome = ctx.controls.end_reasoning(completion_id)
    ...
    ctx.controls.unregister(completion_id)                 # when the completion ends
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar, runtime_checkable

from mlxcel.types import TokenProcessor

ProcessorFactory = Callable[[Any], tuple[TokenProcessor, ...]]  # a prompt -> one choice's processors


class HasProcessors(Protocol):
    """What collect_handles needs of generation parameters (api/generation.GenerationParams):
    a dataclass with a per-choice processor factory. Typed structurally, so this registry
    (held by api/context.ApiContext) never imports api/generation."""

    @property
    def processors(self) -> ProcessorFactory | None: ...


P = TypeVar("P", bound=HasProcessors)


@runtime_checkable
class ReasoningControl(Protocol):
    """What a controllable token processor offers (chat/budget.py ReasoningBudget)."""

    def end_reasoning(self) -> bool:
        """Force the end of reasoning from the next step on; callable from any thread. True
        when the choice has not left its reasoning block yet."""


class ControlOutcome(enum.Enum):
    UNKNOWN = "unknown"  # no running completion has this id (never existed, or finished)
    NOT_OPTED_IN = "not_opted_in"  # running, but started without reasoning_control: true
    ENDING = "ending"  # at least one choice is still reasoning: it ends at the next step
    ALREADY_ENDED = "already_ended"  # every choice has left its reasoning block


@dataclass(frozen=True, slots=True)
class _Entry:
    handles: Sequence[ReasoningControl]
    is_opted_in: bool


class CompletionControls:
    """Running completions by id. Used from the event-loop thread only (register, unregister and
    the control route all run there), so plain dict operations need no lock."""

    def __init__(self) -> None:
        self._live: dict[str, _Entry] = {}

    def register(self, completion_id: str, handles: Sequence[ReasoningControl], *, is_opted_in: bool) -> None:
        """`completion_id` is running; `handles` are its choices' controls (may still be filling)."""
        self._live[completion_id] = _Entry(handles, is_opted_in)

    def unregister(self, completion_id: str) -> None:
        """`completion_id` ended (idempotent)."""
        self._live.pop(completion_id, None)

    def is_running(self, completion_id: str) -> bool:
        return completion_id in self._live

    def end_reasoning(self, completion_id: str) -> ControlOutcome:
        """Tell every choice of `completion_id` to end its reasoning now."""
        entry = self._live.get(completion_id)
        if entry is None:
            return ControlOutcome.UNKNOWN
        if not entry.is_opted_in:
            return ControlOutcome.NOT_OPTED_IN
        still_reasoning = [handle.end_reasoning() for handle in entry.handles]  # every choice, no short-circuit
        return ControlOutcome.ENDING if any(still_reasoning) else ControlOutcome.ALREADY_ENDED


def collect_handles(params: P) -> tuple[P, list[ReasoningControl]]:
    """`params` whose processor factory also appends each choice's controllable processors to the
    returned list (filled as Generation.start makes the choices' requests)."""
    handles: list[ReasoningControl] = []
    make = params.processors
    if make is None:
        return params, handles

    def processors(prompt: Any) -> tuple[TokenProcessor, ...]:
        made = make(prompt)
        handles.extend(p for p in made if isinstance(p, ReasoningControl))
        return made

    return replace(params, processors=processors), handles  # type: ignore[type-var]


__all__ = ["CompletionControls", "ControlOutcome", "ReasoningControl", "collect_handles"]
