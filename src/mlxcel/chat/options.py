"""`ChatOptions`: one chat request's feature settings, typed, as every protocol adapter fills them.

The adapters in `api/` read their own wire fields (OpenAI chat, Responses, Anthropic Messages,
llama-server) and build one frozen `ChatOptions` (api/chat_options.py holds the shared edge
rules, extra_body included): what the request asks of the chat features and how its tokens are
sampled (`sampling`, max_tokens included), decided once; nothing in `chat/` ever sees a request
body or a protocol's field names. Values the chat features check themselves (a reasoning budget
past max_tokens, a grammar llguidance refuses) arrive here already typed; their checks raise
the features' own errors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from mlxcel.types import SamplingParams

ToolMode = Literal["auto", "none", "required"]
ConstraintKind = Literal["format", "json_schema", "gbnf"]


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """Whether the reply may (auto), must (required) or must not (none) call a tool; `name`
    (with required) is the one function it must call."""

    mode: ToolMode = "auto"
    name: str | None = None

    @property
    def is_forced(self) -> bool:
        return self.mode == "required"


AUTO = ToolChoice()


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    """One output format a request asked for (V). `kind` format: a format object
    ({"type": "text" | "json_object" | "json_schema", ...}); json_schema: a bare JSON Schema;
    gbnf: grammar text. `source` names the field for error messages, as the client wrote it."""

    kind: ConstraintKind
    value: Any
    source: str


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """What one chat request asks of the chat features (S, R, Q, P, V) and of the sampler,
    decided by its adapter."""

    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # the request's own, layers merged (S)
    reasoning_effort: str | None = None  # a template kwarg when the template reads it (S)
    reasoning_budget: int | None = None  # checked against max_tokens; None: the server's (R)
    output: tuple[OutputConstraint, ...] = ()  # every constraint given; more than one is an error (V)
    tools: Sequence[Mapping[str, Any]] | None = None  # function tools in the template's (OpenAI) shape
    tool_choice: ToolChoice = AUTO
    parallel_tool_calls: bool = True
    loop_overrides: Mapping[str, int] = field(default_factory=dict)  # loop-guard fields present (P)
    session: str = ""  # the reasoning echo's session key (Q); "" when none
    cache_prompt: bool = True  # false: no prefix cache, no reasoning echo (M, Q)
    remembers_reasoning: bool = True  # False where the route never echoes (Anthropic without thinking)
    reasoning_control: bool = False  # opted in to live control (F5)
    # The engine's sampling, max_tokens included; a route that only renders (a token count,
    # /apply-template) keeps no more than its max_tokens.
    sampling: SamplingParams = field(default_factory=SamplingParams)

    @property
    def allows_parallel_calls(self) -> bool:
        """Whether a reply may make more than one call: a named forced function is exactly one
        call (OpenAI's rule), and `parallel_tool_calls: false` caps any choice at one."""
        return self.parallel_tool_calls and self.tool_choice.name is None

    @property
    def max_tokens(self) -> int | None:
        """The most tokens the reply may have; None: until the context is full."""
        return self.sampling.max_tokens


__all__ = ["AUTO", "ChatOptions", "OutputConstraint", "ToolChoice"]
