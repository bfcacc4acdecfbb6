"""The chat features of issue 6 (S, R, Q, P, V) as every chat-shaped route uses them.

Protocol-neutral: the OpenAI chat, Anthropic Messages and Responses adapters each translate their
wire fields, then

    plan = plan_chat(ctx, body, messages, tools=..., tool_choice=..., max_tokens=..., cache_prompt=...)
    prompt = render_plan(ctx, plan, tools=...)                # template kwargs applied; 400 on failure
    params = with_chat_features(params, plan)                 # processors + output parser per choice
    generation = Generation.start(ctx, [prompt], params, ...)
    ... deltas carry `events` (text/events.py); results carry `reply` ...
    remember_replies(plan, generation.results())              # the reasoning echo (Q)

and map the events to their own JSON.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from mlxcel.api import chat_prompt
from mlxcel.api.context import ApiContext
from mlxcel.api.errors import invalid_request
from mlxcel.api.generation import ChoiceResult, GenerationParams, OutputParser, Prompt
from mlxcel.text.chat_plan import REQUEST_ERRORS, ChatFeatures, ChatPlan
from mlxcel.types import TokenProcessor


def features_of(ctx: ApiContext) -> ChatFeatures:
    """The served model's chat features (built at startup; an ApiContext always has them)."""
    assert ctx.features is not None  # ApiContext.__post_init__ fills in defaults
    return ctx.features


def plan_chat(
    ctx: ApiContext, body: Mapping[str, Any], messages: Sequence[Mapping[str, Any]], *,
    tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: Any = None, parallel_tool_calls: bool = True,
    max_tokens: int | None = None, cache_prompt: bool = True, remembers_reasoning: bool = True,
    reasoning_control: bool = False,
) -> ChatPlan:
    """Template kwargs, reasoning echo, budget, grammar and loop guard for one request, decided
    before rendering. `body` is the JSON as received (extra_body not flattened); `messages` are
    in the template's dict form; `reasoning_control` arms live control (F5, api/control.py).
    An invalid field of these features is a 400."""
    try:
        return features_of(ctx).plan_chat(
            body, messages, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
            max_tokens=max_tokens, cache_prompt=cache_prompt, remembers_reasoning=remembers_reasoning,
            reasoning_control=reasoning_control)
    except REQUEST_ERRORS as exc:
        raise invalid_request(str(exc)) from None


def render_plan(
    ctx: ApiContext, plan: ChatPlan, *, tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True, continue_final_message: bool = False,
) -> Prompt:
    """The prompt for `plan` (its messages and template kwargs); tells the plan the prompt text."""
    prompt = chat_prompt.render_chat_prompt(
        ctx, plan.messages, tools=tools, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, template_kwargs=plan.template_kwargs)
    plan.set_prompt(prompt.text or "")
    return prompt


def with_chat_features(params: GenerationParams, plan: ChatPlan) -> GenerationParams:
    """`params` plus the plan's per-choice processors and output parser. Special tokens stay in
    the text when reasoning or tool-call markers may be special tokens (the parser removes them)."""
    def processors(prompt: Prompt) -> tuple[TokenProcessor, ...]:
        return plan.processors()

    def parser(prompt: Prompt, stops: tuple[str, ...]) -> OutputParser:
        return plan.output_parser(stops)

    skip = params.skip_special_tokens and not plan.keeps_special_tokens
    return replace(params, processors=processors, output_parser=parser, skip_special_tokens=skip)


def with_completion_features(
    ctx: ApiContext, params: GenerationParams, body: Mapping[str, Any], prompts: Sequence[Prompt],
    *, max_tokens: int | None,
) -> GenerationParams:
    """`params` for a raw-prompt completion: reasoning budget, grammar (`json_schema`, `grammar`,
    `response_format`) and loop guard per choice; stop strings spare a budgeted reasoning block.
    Checks the fields first, so an invalid one is a 400 before anything is submitted."""
    features = features_of(ctx)
    try:
        for prompt in prompts:
            features.completion_processors(body, _text(ctx, prompt), max_tokens=max_tokens)
    except REQUEST_ERRORS as exc:
        raise invalid_request(str(exc)) from None

    def processors(prompt: Prompt) -> tuple[TokenProcessor, ...]:
        return features.completion_processors(body, _text(ctx, prompt), max_tokens=max_tokens)

    def parser(prompt: Prompt, stops: tuple[str, ...]) -> OutputParser:
        return features.completion_parser(body, _text(ctx, prompt), stops=stops, max_tokens=max_tokens)

    return replace(params, processors=processors, output_parser=parser)


def remember_replies(plan: ChatPlan, results: Iterable[ChoiceResult]) -> None:
    """Keep each finished plain answer's reasoning for the echo (Q)."""
    for result in results:
        if result.reply is not None and result.finish_reason in ("stop", "length"):
            plan.remember(result.reply)


def _text(ctx: ApiContext, prompt: Prompt) -> str:
    return prompt.text if prompt.text is not None else ctx.tokenizer.decode(prompt.token_ids)
