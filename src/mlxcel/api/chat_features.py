"""The chat features of issue 6 (S, R, Q, P, V) as every chat-shaped route uses them.

Protocol-neutral: the OpenAI chat, Anthropic Messages and Responses adapters each translate their
wire fields into one `ChatOptions` (api/chat_options.py; sampling included), then

    plan = plan_chat(ctx, options, messages)                  # 400 for an invalid feature field
    prompt = render_plan(ctx, plan)                           # template kwargs and tools applied; 400 on failure
    params = with_chat_features(params, plan)                 # the options' sampling, processors + parser per choice
    generation = Generation.start(ctx, [prompt], params, ...)
    ... deltas carry `events` (chat/events.py); results carry `reply` ...
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
from mlxcel.chat.options import ChatOptions
from mlxcel.chat.plan import REQUEST_ERRORS, ChatFeatures, ChatPlan
from mlxcel.types import TokenProcessor


def features_of(ctx: ApiContext) -> ChatFeatures:
    """The served model's chat features (built with the model, serving.served_model.build_served)."""
    return ctx.features


def plan_chat(ctx: ApiContext, options: ChatOptions, messages: Sequence[Mapping[str, Any]]) -> ChatPlan:
    """Template kwargs, reasoning echo, budget, grammar and loop guard for one request, decided
    before rendering. `messages` are in the template's dict form. An invalid field of these
    features is a 400."""
    try:
        return features_of(ctx).plan_chat(options, messages)
    except REQUEST_ERRORS as exc:
        raise invalid_request(str(exc)) from None


def render_plan(
    ctx: ApiContext, plan: ChatPlan, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
) -> Prompt:
    """The prompt for `plan` (its messages, tools and template kwargs); tells the plan the prompt text."""
    prompt = chat_prompt.render_chat_prompt(
        ctx, plan.messages, tools=plan.tools, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, template_kwargs=plan.template_kwargs)
    plan.set_prompt(prompt.text or "")
    return prompt


def with_chat_features(params: GenerationParams, plan: ChatPlan) -> GenerationParams:
    """`params` plus what the plan decided: its options' sampling, the per-choice processors and
    output parser. Special tokens stay in the text when reasoning or tool-call markers may be
    special tokens (the parser removes them)."""
    def processors(prompt: Prompt) -> tuple[TokenProcessor, ...]:
        return plan.processors()

    def parser(prompt: Prompt, stops: tuple[str, ...]) -> OutputParser:
        return plan.output_parser(stops)

    skip = params.skip_special_tokens and not plan.keeps_special_tokens
    return replace(params, sampling=plan.options.sampling, processors=processors, output_parser=parser,
                   skip_special_tokens=skip)


def with_completion_features(
    ctx: ApiContext, params: GenerationParams, options: ChatOptions, prompts: Sequence[Prompt],
) -> GenerationParams:
    """`params` for a raw-prompt completion: the options' sampling, and reasoning budget, grammar
    (`json_schema`, `grammar`, `response_format`) and loop guard per choice; stop strings spare a
    budgeted reasoning block. Checks the fields first, so an invalid one is a 400 before anything
    is submitted."""
    features = features_of(ctx)
    try:
        for prompt in prompts:
            features.completion_processors(options, _text(ctx, prompt))
    except REQUEST_ERRORS as exc:
        raise invalid_request(str(exc)) from None

    def processors(prompt: Prompt) -> tuple[TokenProcessor, ...]:
        return features.completion_processors(options, _text(ctx, prompt))

    def parser(prompt: Prompt, stops: tuple[str, ...]) -> OutputParser:
        return features.completion_parser(options, _text(ctx, prompt), stops=stops)

    return replace(params, sampling=options.sampling, processors=processors, output_parser=parser)


def remember_replies(plan: ChatPlan, results: Iterable[ChoiceResult]) -> None:
    """Keep each finished plain answer's reasoning for the echo (Q)."""
    for result in results:
        if result.reply is not None and result.finish_reason in ("stop", "length"):
            plan.remember(result.reply)


def _text(ctx: ApiContext, prompt: Prompt) -> str:
    return prompt.text if prompt.text is not None else ctx.tokenizer.decode(prompt.token_ids)
