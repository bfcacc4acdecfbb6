"""The chat features of issue 6 behind one small interface, so each protocol route wires them in
a few calls (S, R, Q, P, V).

At startup, per served model:

    features = ChatFeatures.build(tokenizer, template, FeatureSettings(...), model_name=..., model_type=...)

Per chat request (any protocol; its adapter filled the typed `ChatOptions`):

    plan = features.plan_chat(options, messages)               # REQUEST_ERRORS -> 400
    text = template.render(plan.messages, tools=options.tools, **plan.template_kwargs)   # TemplateError -> 400
    plan.set_prompt(text)                                      # primed-think detection
    Request(..., processors=plan.processors())                 # fresh per choice
    parser = plan.output_parser(stops)                         # one per choice; stops match the answer
    for each text delta: events = parser.feed(delta)           # chat/events.py; parser.stop ends it
    at the end:         events = parser.finish(); plan.remember(parser.result())

Per raw completion (llama-server /completion, OpenAI /v1/completions):

    processors = features.completion_processors(options, prompt_text)
    parser = features.completion_parser(options, prompt_text, stops=...)  # per choice
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlxcel.chat.budget import (
    UNLIMITED, BudgetError, make_budget_processor, parse_server_budget, resolve_thinking_budget,
    warn_if_unsupported,
)  # fmt: skip
from mlxcel.chat.options import ChatOptions
from mlxcel.chat.output import ChatOutputParser, ParsedReply
from mlxcel.text.chat_template import ChatTemplate
from mlxcel.chat.completion_output import CompletionOutputParser
from mlxcel.chat.grammar import Grammar, GrammarCompiler, GrammarError, LazyGrammar, declared_tool_names
from mlxcel.chat.lazy_grammar import make_lazy_processor
from mlxcel.chat.loop_guard import (
    LoopGuardError, LoopPolicy, family_policy, make_loop_guard, parse_operator_override, resolve_loop_policy,
)  # fmt: skip
from mlxcel.chat.reasoning import ReasoningFormat, ThinkTokens, infer_think_tokens, is_primed
from mlxcel.chat.reasoning_echo import ReasoningEcho, echo_applies, template_signature
from mlxcel.chat.template_kwargs import (
    TemplateKwargsError, effective_template_kwargs, preserves_thinking, server_template_kwargs,
    strip_stale_thinking, with_thinking_default,
)  # fmt: skip
from mlxcel.text.tokenizer import Tokenizer
from mlxcel.chat.tools import make_tool_parser, select_tool_parser
from mlxcel.types import TokenProcessor

log = logging.getLogger(__name__)

# Every per-request error of these features; each is a ValueError whose message suits a 400.
REQUEST_ERRORS = (TemplateKwargsError, BudgetError, GrammarError, LoopGuardError)


@dataclass(frozen=True, slots=True)
class FeatureSettings:
    """Server-wide settings, as the CLI and environment give them (raw strings where the
    feature module parses them, so its errors refuse startup with its own message)."""

    reasoning_format: str = "auto"  # --reasoning-format
    reasoning_budget: int | str | None = None  # --reasoning-budget / LLAMA_ARG_REASONING_BUDGET
    chat_template_kwargs: str | None = None  # --chat-template-kwargs
    chat_template_kwargs_env: str | None = None  # LLAMA_ARG_CHAT_TEMPLATE_KWARGS
    loop_detection: str | None = None  # MLXCEL_LOOP_DETECTION
    echo_max_bytes: int = 16 << 20  # MLXCEL_REASONING_ECHO_MAX_BYTES; 0 disables
    skip_chat_parsing: bool = False  # --skip-chat-parsing

    def checked(self) -> FeatureSettings:
        """These settings, after parsing each (a ValueError naming the flag or variable), so the
        server refuses to start before loading a model."""
        ReasoningFormat.parse(self.reasoning_format)
        parse_server_budget(self.reasoning_budget)
        server_template_kwargs(self.chat_template_kwargs, self.chat_template_kwargs_env)
        parse_operator_override(self.loop_detection)
        if self.echo_max_bytes < 0:
            raise ValueError(f"MLXCEL_REASONING_ECHO_MAX_BYTES must be 0 (off) or more, not {self.echo_max_bytes}")
        return self


@dataclass(frozen=True)
class ChatFeatures:
    """Per served model: its markers, tool format, grammar compiler, echo store and defaults."""

    model_name: str
    template: ChatTemplate | None
    think: ThinkTokens | None
    reasoning_format: ReasoningFormat
    reasoning_budget: int
    template_kwargs: Mapping[str, Any]  # server defaults (enable_thinking added for thinking models)
    tool_parser_name: str  # what /health reports as tool_call_parser
    loop_family: LoopPolicy
    loop_operator: Mapping[str, int]
    grammar: GrammarCompiler
    echo: ReasoningEcho
    skip_chat_parsing: bool = False

    @classmethod
    def build(
        cls, tokenizer: Tokenizer, template: ChatTemplate | None, settings: FeatureSettings, *,
        model_name: str, model_type: str,
    ) -> ChatFeatures:
        """Parse and check the settings (a ValueError refuses startup); logs the thinking default."""
        think = infer_think_tokens(tokenizer)
        budget = parse_server_budget(settings.reasoning_budget)
        warn_if_unsupported(budget, think)
        defaults = server_template_kwargs(settings.chat_template_kwargs, settings.chat_template_kwargs_env)
        return cls(
            model_name=model_name, template=template, think=think,
            reasoning_format=ReasoningFormat.parse(settings.reasoning_format), reasoning_budget=budget,
            template_kwargs=with_thinking_default(defaults, think),
            tool_parser_name=select_tool_parser(template.source if template else None),
            loop_family=family_policy(model_type), loop_operator=parse_operator_override(settings.loop_detection),
            grammar=GrammarCompiler(tokenizer), echo=ReasoningEcho(max_bytes=settings.echo_max_bytes),
            skip_chat_parsing=settings.skip_chat_parsing,
        )

    def plan_chat(self, options: ChatOptions, messages: Sequence[Mapping[str, Any]]) -> ChatPlan:
        """Everything decided before rendering; raises one of REQUEST_ERRORS (a 400).

        `messages` are the client's, in the template's dict form; `options.remembers_reasoning`
        is False where the route does not echo (Anthropic without extended thinking);
        `options.reasoning_control` (F5) gives each choice a budget processor that can be told
        to end its reasoning while it runs.
        """
        tools = options.tools
        self.grammar.check_tools(tools)
        kwargs = effective_template_kwargs(self.template_kwargs, options.template_kwargs, options.reasoning_effort,
                                           self.template)
        signature = template_signature(self.template.source if self.template else "", kwargs, tools)
        is_echo_on = self._is_echo_on(options.cache_prompt, options.remembers_reasoning)
        rendered = [dict(m) for m in messages]
        if is_echo_on:
            rendered = self.echo.restore(messages, model=self.model_name, signature=signature, session=options.session)
        if not preserves_thinking(kwargs):
            rendered = strip_stale_thinking(rendered, self.think)
        uses_tools = bool(tools) and options.tool_choice.mode != "none" and not self.skip_chat_parsing
        grammar = self._chat_grammar(options)
        return ChatPlan(
            features=self, options=options, messages=rendered, template_kwargs=kwargs, client_messages=list(messages),
            budget=resolve_thinking_budget(options.reasoning_budget, self.reasoning_budget),
            grammar=grammar, tool_grammar=self._lazy_tool_grammar(options) if uses_tools and grammar is None else None,
            loop_policy=resolve_loop_policy(self.loop_family, self.loop_operator, options.loop_overrides),
            tool_format=self.tool_parser_name if uses_tools else None,
            signature=signature, is_echo_on=is_echo_on,
        )

    def completion_processors(self, options: ChatOptions, prompt_text: str) -> tuple[TokenProcessor, ...]:
        """Budget, grammar and loop guard for a raw-prompt completion; raises REQUEST_ERRORS."""
        budget = resolve_thinking_budget(options.reasoning_budget, self.reasoning_budget)
        grammar = self.grammar.from_constraints(options.output)
        policy = resolve_loop_policy(self.loop_family, self.loop_operator, options.loop_overrides)
        return _processors(self, budget, grammar, policy, is_primed(prompt_text, self.think))

    def completion_parser(
        self, options: ChatOptions, prompt_text: str, *, stops: Sequence[str]
    ) -> CompletionOutputParser:
        """The raw text parser for a completion: when the request budgets reasoning, its stop
        strings skip the reasoning block, so a forced `</think>` never stops it (R)."""
        budget = resolve_thinking_budget(options.reasoning_budget, self.reasoning_budget)
        think = self.think if budget != UNLIMITED else None
        return CompletionOutputParser(think, starts_in_reasoning=is_primed(prompt_text, self.think), stops=stops)

    def _chat_grammar(self, options: ChatOptions) -> Grammar | None:
        output = self.grammar.from_constraints(options.output)
        calls = self.grammar.tool_calls(self.tool_parser_name, options.tools, options.tool_choice,
                                        parallel=options.allows_parallel_calls)
        # A forced call is the whole output, so its grammar wins; the format is for text (as OpenAI:
        # instructor sends a forced tool with `text.format`).
        return calls if calls is not None else output

    def _lazy_tool_grammar(self, options: ChatOptions) -> LazyGrammar | None:
        """tool_choice auto: calls are free to come, but once one opens it names a declared tool
        with fitting arguments (issue 26)."""
        return self.grammar.triggered_tool_calls(self.tool_parser_name, options.tools, options.tool_choice,
                                                 parallel=options.allows_parallel_calls)

    def _is_echo_on(self, cache_prompt: bool, route_on: bool) -> bool:
        applies = echo_applies(cache_prompt=cache_prompt, reasoning_format=self.reasoning_format,
                               skip_chat_parsing=self.skip_chat_parsing)
        return route_on and applies and self.echo.is_enabled


@dataclass
class ChatPlan:
    """One chat request's decisions; make processors and parsers from it per choice."""

    features: ChatFeatures
    options: ChatOptions
    messages: list[dict[str, Any]]  # render these (echo restored, stale thinking stripped)
    template_kwargs: dict[str, Any]  # and pass these to ChatTemplate.render
    client_messages: list[Mapping[str, Any]]
    budget: int
    grammar: Grammar | None
    tool_grammar: LazyGrammar | None  # the call grammar from the opener on, under tool_choice auto
    loop_policy: LoopPolicy
    tool_format: str | None  # None: no tool parsing
    signature: str
    is_echo_on: bool
    starts_in_reasoning: bool = field(default=False)

    @property
    def tools(self) -> Sequence[Mapping[str, Any]] | None:
        """The tools the template renders (the request's, in the template's shape)."""
        return self.options.tools

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the choice's TextAssembler must keep special tokens in its text: reasoning and
        tool-call markers are often special tokens (`[TOOL_CALLS]`, `<|python_tag|>`, Gemma 4's
        `<|channel>`); the parser removes them. End-of-sequence tokens stay hidden either way."""
        return self.tool_format is not None or (
            self.features.think is not None and self.features.reasoning_format.is_parsed
            and not self.features.skip_chat_parsing
        )

    def set_prompt(self, prompt_text: str) -> None:
        """After rendering: a prompt that ends inside `<think>` makes the reply start as reasoning."""
        self.starts_in_reasoning = is_primed(prompt_text, self.features.think)

    def processors(self) -> tuple[TokenProcessor, ...]:
        """Fresh TokenProcessors for one choice's engine Request."""
        return _processors(self.features, self.budget, self.grammar, self.loop_policy, self.starts_in_reasoning,
                           is_controlled=self.options.reasoning_control, tool_grammar=self.tool_grammar)

    def output_parser(self, stops: Sequence[str] = ()) -> ChatOutputParser:
        """A fresh parser for one choice's text deltas; `stops` end the answer (not the reasoning)."""
        features = self.features
        reasoning_format = ReasoningFormat.NONE if features.skip_chat_parsing else features.reasoning_format
        # Only the request's own tools can be called: another name stays text (issue 26).
        declared = declared_tool_names(self.tools)
        tools = make_tool_parser(self.tool_format, declared=declared, tools=self.tools) if self.tool_format else None
        return ChatOutputParser(think=features.think, reasoning_format=reasoning_format,
                                starts_in_reasoning=self.starts_in_reasoning, tool_parser=tools, stops=stops,
                                max_tool_calls=None if self.options.allows_parallel_calls else 1)

    def remember(self, reply: ParsedReply) -> None:
        """After a finished plain answer: keep its reasoning for the echo (Q)."""
        if not self.is_echo_on or reply.has_tool_calls:
            return
        self.features.echo.remember(model=self.features.model_name, signature=self.signature,
                                    session=self.options.session,
                                    messages=self.client_messages, content=reply.content, reasoning=reply.reasoning)


def _processors(
    features: ChatFeatures, budget: int, grammar: Grammar | None, policy: LoopPolicy, primed: bool, *,
    is_controlled: bool = False, tool_grammar: LazyGrammar | None = None,
) -> tuple[TokenProcessor, ...]:
    # Order matters only for `process`: the budget may force `</think>`; the grammars are idle
    # while reasoning; the loop guard only watches.
    compiler = features.grammar
    found: list[TokenProcessor | None] = [
        make_budget_processor(features.think, budget, starts_in_reasoning=primed, is_controlled=is_controlled),
        compiler.processor(grammar, think=features.think, starts_in_reasoning=primed) if grammar else None,
        make_lazy_processor(compiler, tool_grammar, think=features.think, starts_in_reasoning=primed)
        if tool_grammar else None,
        make_loop_guard(policy),
    ]
    return tuple(p for p in found if p is not None)


__all__ = ["REQUEST_ERRORS", "ChatFeatures", "ChatOptions", "ChatPlan", "FeatureSettings", "ParsedReply"]
