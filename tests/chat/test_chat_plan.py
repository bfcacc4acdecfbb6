"""The issue-6 facade (S, R, Q, P, V) driven the way a route drives it: plan, render, processors,
per-token text through the TextAssembler into the output parser, remember, and the echo on
the follow-up. Real template rendering, real tokenizer, scripted model output."""

from __future__ import annotations

from typing import Any

import pytest

from mlxcel.chat.budget import ReasoningBudget
from mlxcel.chat.plan import REQUEST_ERRORS, ChatFeatures, ChatPlan, FeatureSettings
from mlxcel.text.chat_template import ChatTemplate
from mlxcel.chat.events import ContentDelta, OutputEvent, ReasoningDelta, ToolCallStart
from mlxcel.chat.grammar import GrammarProcessor
from mlxcel.chat.loop_guard import LoopGuard
from mlxcel.text.output import TextAssembler
from mlxcel.text.tokenizer import Tokenizer
from mlxcel.types import FinishReason
from tests.chat.wire import chat_options

# Qwen3-like: primes `<think>\n` when thinking is on, renders reasoning_content, teaches <tool_call>.
QWEN_LIKE = ChatTemplate(
    "{% if tools %}<|im_start|>system\nCall tools as <tool_call>{json}</tool_call>.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def features(byte_level_tokenizer: Tokenizer) -> ChatFeatures:
    return ChatFeatures.build(byte_level_tokenizer, QWEN_LIKE, FeatureSettings(), model_name="tiny",
                              model_type="qwen3")


def stream(plan: ChatPlan, tokenizer: Tokenizer, reply: str) -> list[OutputEvent]:
    """The model 'writes' `reply`: its tokens go one by one through the assembler and parser."""
    assembler = TextAssembler(tokenizer)
    parser = plan.output_parser()
    events: list[OutputEvent] = []
    for token in tokenizer.encode(reply, add_special_tokens=False):
        events += parser.feed(assembler.push([token]).text)
    events += parser.feed(assembler.finish()) + parser.finish()
    plan.remember(parser.result())
    return events


def render(plan: ChatPlan, tools: list[dict[str, Any]] | None = None) -> str:
    text = QWEN_LIKE.render(plan.messages, tools=tools, **plan.template_kwargs)
    plan.set_prompt(text)
    return text


def test_s_startup_defaults(features: ChatFeatures) -> None:
    assert features.think is not None and features.think.start == "<think>"
    assert features.template_kwargs == {"enable_thinking": True}
    assert features.tool_parser_name == "hermes"
    assert not features.loop_family.is_enabled


def test_v_q_tool_call_reply_after_primed_reasoning(features: ChatFeatures, byte_level_tokenizer: Tokenizer) -> None:
    plan = features.plan_chat(chat_options({}, tools=TOOLS, tool_choice="auto", max_tokens=100), QUESTION)
    assert render(plan, TOOLS).endswith("<think>\n") and plan.starts_in_reasoning
    # No budget, no forced call, no loop guard on this family: only the call grammar that waits
    # for `<tool_call>` (issue 26).
    assert [type(p).__name__ for p in plan.processors()] == ["LazyGrammarProcessor"]
    events = stream(plan, byte_level_tokenizer,
                    'The user wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                    '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>')
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == "The user wants weather."
    assert not [e for e in events if isinstance(e, ContentDelta)]
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [s.name for s in starts] == ["get_weather"]
    assert features.echo.num_entries == 0  # tool-call replies are not remembered
    assert plan.keeps_special_tokens


def test_q_plain_answer_is_remembered_and_echoed_into_the_follow_up(
    features: ChatFeatures, byte_level_tokenizer: Tokenizer
) -> None:
    body = {"user": "alice"}
    plan = features.plan_chat(chat_options(body, max_tokens=100), QUESTION)
    first_prompt = render(plan)
    stream(plan, byte_level_tokenizer, "Sunny, I recall.\n</think>\n\nIt is sunny.")
    follow_up = [*QUESTION, {"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "And Rome?"}]
    plan2 = features.plan_chat(chat_options(body, max_tokens=100), follow_up)
    assert plan2.messages[1]["reasoning_content"] == "Sunny, I recall."
    second_prompt = render(plan2)
    # The follow-up starts with the first prompt plus what the model wrote: a prefix-cache hit.
    assert second_prompt.startswith(first_prompt + "Sunny, I recall.\n</think>\n\nIt is sunny.")
    off = features.plan_chat(chat_options({**body, "cache_prompt": False}, max_tokens=100), follow_up)
    assert "reasoning_content" not in off.messages[1]


def test_r_p_v_processors_per_request(byte_level_tokenizer: Tokenizer) -> None:
    gemma4 = ChatFeatures.build(byte_level_tokenizer, QWEN_LIKE, FeatureSettings(reasoning_budget="8"),
                                model_name="tiny", model_type="gemma4")
    plan = gemma4.plan_chat(chat_options({"response_format": {"type": "json_object"}}, max_tokens=100), QUESTION)
    render(plan)
    kinds = [type(p) for p in plan.processors()]
    assert kinds == [ReasoningBudget, GrammarProcessor, LoopGuard]
    assert plan.processors()[0] is not plan.processors()[0]  # fresh state per choice
    unlimited = gemma4.plan_chat(chat_options({"thinking_budget_tokens": -1, "max_pattern_size": 0}, max_tokens=100),
                                 QUESTION)
    assert unlimited.processors() == ()


def test_issue26_a_forced_call_with_an_output_format_is_planned_as_the_call(features: ChatFeatures) -> None:
    body = {"response_format": {"type": "json_object"}}
    plan = features.plan_chat(chat_options(body, tools=TOOLS, tool_choice="required", max_tokens=100), QUESTION)
    assert plan.grammar is not None and plan.grammar.source == "tools"


def test_v_required_tool_choice_adds_the_call_grammar(features: ChatFeatures) -> None:
    plan = features.plan_chat(chat_options({}, tools=TOOLS, tool_choice="required", max_tokens=100), QUESTION)
    assert plan.grammar is not None and plan.grammar.source == "tools"
    none = features.plan_chat(chat_options({}, tools=TOOLS, tool_choice="none", max_tokens=100), QUESTION)
    assert none.grammar is None and none.tool_format is None


@pytest.mark.parametrize(("body", "kwargs"), [
    ({"thinking_budget_tokens": 500}, {"max_tokens": 100}),
    ({"chat_template_kwargs": "x"}, {}),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, {}),
    ({"min_count": 1}, {}),
    ({}, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}),
])  # fmt: skip
def test_bad_requests_fail_before_rendering(
    features: ChatFeatures, body: dict[str, Any], kwargs: dict[str, Any]
) -> None:
    with pytest.raises(REQUEST_ERRORS):
        features.plan_chat(chat_options(body, **kwargs), QUESTION)


def test_r_skip_chat_parsing_and_format_none(byte_level_tokenizer: Tokenizer) -> None:
    raw = ChatFeatures.build(byte_level_tokenizer, QWEN_LIKE, FeatureSettings(skip_chat_parsing=True),
                             model_name="tiny", model_type="qwen3")
    plan = raw.plan_chat(chat_options({}, tools=TOOLS, max_tokens=100), QUESTION)
    render(plan)
    events = stream(plan, byte_level_tokenizer, 'x</think><tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert all(isinstance(e, ContentDelta) for e in events)
    assert not plan.keeps_special_tokens
    assert raw.echo.num_entries == 0


@pytest.mark.parametrize("settings", [
    FeatureSettings(reasoning_format="qwen"),
    FeatureSettings(reasoning_budget="-3"),
    FeatureSettings(chat_template_kwargs="{bad json"),
    FeatureSettings(loop_detection="sometimes"),
])  # fmt: skip
def test_bad_server_settings_refuse_startup(byte_level_tokenizer: Tokenizer, settings: FeatureSettings) -> None:
    with pytest.raises(ValueError):
        ChatFeatures.build(byte_level_tokenizer, QWEN_LIKE, settings, model_name="tiny", model_type="qwen3")


def test_completion_processors(features: ChatFeatures) -> None:
    options = chat_options({"thinking_budget_tokens": 4, "json_schema": {"type": "object"}}, max_tokens=16)
    processors = features.completion_processors(options, "<|im_start|>assistant\n<think>\n")
    assert [type(p) for p in processors] == [ReasoningBudget, GrammarProcessor]


@pytest.mark.parametrize(("choice", "parallel", "is_one_call"), [
    ({"type": "function", "function": {"name": "get_weather"}}, True, True),  # a named function: one call (OpenAI)
    ("required", False, True),  # parallel_tool_calls false caps any forced choice
    ("required", True, False),  # required with parallel calls: another call may follow
])
def test_issue46_a_named_tool_or_parallel_false_ends_the_grammar_after_one_call(
        features: ChatFeatures, byte_level_tokenizer: Tokenizer, choice: Any, parallel: bool, is_one_call: bool) -> None:
    """After one whole call, the forced grammar ends the reply; the parser keeps one call too."""
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}  # the grammar starts at the reply's start
    plan = features.plan_chat(chat_options(no_thinking, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel,
                                           max_tokens=100), QUESTION)
    render(plan, TOOLS)
    (grammar,) = [p for p in plan.processors() if isinstance(p, GrammarProcessor)]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    finishes = [grammar.accept(token) for token in byte_level_tokenizer.encode(call, add_special_tokens=False)]
    assert not any(finishes[:-1])
    assert (finishes[-1] is FinishReason.STOP) == is_one_call  # the grammar ended with the call, or goes on
    starts = [e for e in stream(plan, byte_level_tokenizer, f"{call}\n{call}") if isinstance(e, ToolCallStart)]
    assert len(starts) == (1 if is_one_call else 2)
