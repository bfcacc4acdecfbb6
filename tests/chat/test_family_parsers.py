"""Issue 40 (V, R): the tool-call and reasoning formats of the newer families, each chosen from its
chat template: gpt-oss harmony, DeepSeek-V3 / R1 / V3.1, Qwen3-Coder XML, GLM-4.5 and Mistral's
two `[TOOL_CALLS]` forms.

Every reply is fed whole, one character at a time and in random chunkings: each gives the same
reasoning, content and calls (the streamed result equals the non-streamed one), and the argument
fragments of each call concatenate to its final JSON.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

from mlxcel.chat.events import ContentDelta, OutputEvent, ReasoningDelta
from mlxcel.chat.harmony import HARMONY_MARKERS, HarmonySplitter, reply_splitter
from mlxcel.chat.output import ChatOutputParser
from mlxcel.chat.reasoning import ReasoningFormat, ReasoningSplitter, ThinkTokens
from mlxcel.chat.tools import make_tool_parser, select_tool_parser
from mlxcel.chat.tools.xml_calls import argument_value
from tests.chat.test_tool_parsers import Call, summarize

WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "code": {"type": "string"},
        "units": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]  # fmt: skip


def chunkings(text: str, *, seed: int = 0, count: int = 40) -> Iterator[list[str]]:
    """The whole text, one character at a time, and `count` random chunkings."""
    yield [text]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(count):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def run_format(fmt: str, pieces: list[str], declared: tuple[str, ...] | None = None) -> list[OutputEvent]:
    counter = iter(range(1000))
    parser = make_tool_parser(fmt, new_id=lambda: f"id{next(counter)}", declared=declared, tools=WEATHER_TOOLS)
    events: list[OutputEvent] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


TOOL_CASES: list[tuple[str, str, str, list[Call]]] = [
    # Qwen3-Coder: values by the schema (`code` stays a string, `days` is a number), a multi-line value.
    ("qwen3_coder", "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n<parameter=code>\n007\n</parameter>\n</function>\n</tool_call>",
     "Let me check.", [("get_weather", {"city": "New York", "days": 3, "code": "007"})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nline one\nline two\n</parameter>\n"
     "</function>\n</tool_call>\n<tool_call>\n<function=noop>\n</function>\n</tool_call>",
     "", [("get_weather", {"city": "line one\nline two"}), ("noop", {})]),
    # a model that leaves out `</parameter>` and the `<tool_call>` opener
    ("qwen3_coder", "<function=get_weather>\n<parameter=city>\nParis\n<parameter=units>\nnull\n</function>",
     "", [("get_weather", {"city": "Paris", "units": None})]),
    ("qwen3_coder", "Use <b>tags</b> and a < b.", "Use <b>tags</b> and a < b.", []),
    # GLM-4.5 (line breaks) and GLM-4.7 (none); JSON values for non-string parameters.
    ("glm45", "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
     "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>", "", [("get_weather", {"city": "Paris", "days": 2})]),
    ("glm45", "On it.<tool_call>get_weather<arg_key>city</arg_key><arg_value>[\"Rome\", 1]</arg_value></tool_call>"
     "<tool_call>noop</tool_call>", "On it.", [("get_weather", {"city": '["Rome", 1]'}), ("noop", {})]),
    ("glm45", "<tool_call>search<arg_key>q</arg_key><arg_value>{\"a\": [1, 2]}</arg_value></tool_call>", "",
     [("search", {"q": {"a": [1, 2]}})]),
    # DeepSeek-V3 / R1 (type, name line, ```json fence) and V3.1 (name<sep>json).
    ("deepseek", "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
     '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>noop\n```json\n{}\n```'
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Checking.", [("get_weather", {"city": "Paris"}), ("noop", {})]),
    ("deepseek", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo", "days": 1}'
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>Done.", "Done.", [("get_weather", {"city": "Oslo", "days": 1})]),
    # Mistral: the JSON-list form and the name[ARGS] form of newer templates (with a call id too).
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "",
     [("get_weather", {"city": "Paris"})]),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}[TOOL_CALLS]noop[ARGS]{}', "",
     [("get_weather", {"city": "Paris"}), ("noop", {})]),
    # harmony's tool parser reads the canonical spelling chat/harmony.py writes.
    ("harmony", 'Sure.<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
     "<|call|>", "Sure.", [("get_weather", {"city": "Paris"})]),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "reply", "content", "calls"), TOOL_CASES)
def test_issue40_v_every_chunking_gives_the_same_content_and_calls(
    fmt: str, reply: str, content: str, calls: list[Call]
) -> None:
    for pieces in chunkings(reply):
        assert summarize(run_format(fmt, pieces)) == (content, calls), pieces


@pytest.mark.parametrize(("fmt", "reply", "content", "calls"), [c for c in TOOL_CASES if c[3]])
def test_issue40_v_cut_off_replies_give_parseable_arguments(fmt: str, reply: str, content: str, calls: list[Call]) -> None:
    for cut in range(0, len(reply) + 1, 3):
        got_content, got_calls = summarize(run_format(fmt, [reply[:cut]]))  # the checks are summarize's
        assert {name for name, _ in got_calls} <= {name for name, _ in calls}, cut


UNDECLARED: list[tuple[str, str, str, list[Call]]] = [
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>",
     "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>", []),
    ("glm45", "<tool_call>get_time<arg_key>tz</arg_key><arg_value>UTC</arg_value></tool_call>",
     "<tool_call>get_time<arg_key>tz</arg_key><arg_value>UTC</arg_value></tool_call>", []),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", []),
    ("harmony", "<|channel|>commentary to=python <|constrain|>json<|message|>{}<|call|>",
     "<|channel|>commentary to=python <|constrain|>json<|message|>{}<|call|>", []),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "reply", "content", "calls"), UNDECLARED)
def test_issue40_v_a_call_to_an_undeclared_tool_stays_text(fmt: str, reply: str, content: str, calls: list[Call]) -> None:
    for pieces in chunkings(reply, count=10):
        assert summarize(run_format(fmt, pieces, declared=("get_weather", "noop"))) == (content, calls), pieces


def test_issue40_v_xml_values_follow_the_schema_then_json_then_text() -> None:
    assert argument_value("42", {"type": "string"}) == "42"
    assert argument_value("42", {"type": "integer"}) == 42
    assert argument_value("42", None) == 42
    assert argument_value("[1, true]", {"type": "array"}) == [1, True]
    assert argument_value("Paris", {"type": "integer"}) == "Paris"  # not JSON: the text, for the client to judge


# ---- harmony: the whole reply, reasoning included ----

HARMONY = ThinkTokens(*HARMONY_MARKERS, (1,), (2,))  # the ids matter only on the engine side
CALL = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"

HARMONY_CASES: list[tuple[str, str, str, list[Call]]] = [
    ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}', "Need the weather.", "",
     [("get_weather", {"city": "Paris"})]),
    ("<|channel|>analysis<|message|>2 + 2 is 4.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
     "2 + 2 is 4.", "2 + 2 = 4.", []),
    # a preamble on commentary is for the user; the recipient in the role part of the header
    ("<|channel|>analysis<|message|>Plan.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking now."
     '<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"days": 2}<|call|>',
     "Plan.", "Checking now.", [("get_weather", {"days": 2})]),
    ("<|channel|>final<|message|>Hello there.", "", "Hello there.", []),
    ("Plain text, no harmony at all.", "", "Plain text, no harmony at all.", []),
]  # fmt: skip


def run_harmony(pieces: list[str], *, tools: bool = True) -> tuple[list[OutputEvent], ChatOutputParser]:
    counter = iter(range(1000))
    tool_parser = make_tool_parser("harmony", new_id=lambda: f"id{next(counter)}") if tools else None
    parser = ChatOutputParser(think=HARMONY, tool_parser=tool_parser)
    events: list[OutputEvent] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish(), parser


@pytest.mark.parametrize(("reply", "reasoning", "content", "calls"), HARMONY_CASES)
def test_issue40_harmony_channels_split_the_same_in_every_chunking(
    reply: str, reasoning: str, content: str, calls: list[Call]
) -> None:
    for pieces in chunkings(reply):
        events, parser = run_harmony(pieces)
        streamed = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        assert (streamed, *summarize(events)) == (reasoning, content, calls), pieces
        result = parser.result()  # the non-streaming reply
        assert (result.reasoning, result.content, [(c.name, json.loads(c.arguments)) for c in result.tool_calls]) == (
            reasoning, content, calls)


@pytest.mark.parametrize(("reply", "reasoning", "content", "calls"), HARMONY_CASES[:3])
def test_issue40_harmony_cut_off_replies_leak_no_markup(reply: str, reasoning: str, content: str, calls: list[Call]) -> None:
    for cut in range(len(reply) + 1):
        events, parser = run_harmony([reply[:cut]])
        got_content, got_calls = summarize(events)  # the call protocol holds (parseable arguments)
        result = parser.result()
        # a lone `<` may be text; a cut-off marker (`<|en`) never shows
        assert reasoning.startswith(result.reasoning.removesuffix("<")), cut
        assert content.startswith(got_content.removesuffix("<")) and "<|" not in got_content + result.reasoning, cut
        assert {name for name, _ in got_calls} <= {name for name, _ in calls}, cut


def test_issue40_harmony_without_tools_keeps_the_call_as_text() -> None:
    reply = HARMONY_CASES[0][0]
    events, parser = run_harmony(list(reply), tools=False)
    assert parser.result().reasoning == "Need the weather."
    assert parser.result().content == CALL + '{"city": "Paris"}<|call|>'


def test_issue40_harmony_splitter_is_chosen_by_its_markers_and_legacy_keeps_the_raw_text() -> None:
    auto = dict(reasoning_format=ReasoningFormat.AUTO, starts_in_reasoning=False)
    assert isinstance(reply_splitter(HARMONY_MARKERS, **auto), HarmonySplitter)
    assert isinstance(reply_splitter(("<think>", "</think>"), **auto), ReasoningSplitter)
    legacy = HarmonySplitter(reasoning_format=ReasoningFormat.DEEPSEEK_LEGACY)
    text = HARMONY_CASES[1][0]
    events = legacy.feed(text) + legacy.finish()
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == text
    assert legacy.reasoning_text == "2 + 2 is 4."


# ---- <think> reasoning with the families' calls (GLM-4.5, DeepSeek-R1) ----

THINK = ThinkTokens("<think>", "</think>", (1,), (2,))


@pytest.mark.parametrize(("fmt", "reply", "primed"), [
    ("glm45", "\n<think>Need Paris.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
     "<arg_value>Paris</arg_value>\n</tool_call>", False),
    ("deepseek", "Need Paris.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
     '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', True),  # R1: `<think>\n` was in the prompt
])  # fmt: skip
def test_issue40_r_think_reasoning_then_calls(fmt: str, reply: str, primed: bool) -> None:
    for pieces in chunkings(reply, count=10):
        tool_parser = make_tool_parser(fmt, tools=WEATHER_TOOLS)
        parser = ChatOutputParser(think=THINK, starts_in_reasoning=primed, tool_parser=tool_parser)
        for piece in pieces:
            parser.feed(piece)
        parser.finish()
        result = parser.result()
        assert (result.reasoning, result.content) == ("Need Paris.", ""), pieces
        assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [("get_weather", {"city": "Paris"})]


# ---- choosing the format from the template ----

TEMPLATES: list[tuple[str, str]] = [
    # gpt-oss (its template prints harmony's headers)
    ("{{- '<|start|>assistant<|channel|>commentary to=functions.' + tool_call.name + ' <|constrain|>json<|message|>' }}",
     "harmony"),
    # DeepSeek-V3 and V3.1
    ("{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name']"
     " + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}", "deepseek"),
    # Qwen3-Coder: `<tool_call>` around `<function=...>` tags
    ("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{{- '<parameter=' + args_name + '>\\n' }}", "qwen3_coder"),
    # GLM-4.5: `<tool_call>` around `<arg_key>` tags
    ("{{ '\\n<tool_call>' + tc.name }}{% for k, v in _args.items() %}\\n<arg_key>{{ k }}</arg_key>\\n"
     "<arg_value>{{ v }}</arg_value>{% endfor %}", "glm45"),
    # Mistral, both forms
    ("{{- '[TOOL_CALLS]' + tool.function.name + '[ARGS]' + tool.function.arguments|tojson }}", "mistral_args"),
    ("{{ '[TOOL_CALLS][' }}{% for tc in tool_calls %}{{ tc | tojson }}{% endfor %}{{ ']' }}", "mistral"),
    # Qwen3 / Hermes JSON calls stay Hermes
    ('<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>', "hermes"),
]  # fmt: skip


@pytest.mark.parametrize(("source", "expected"), TEMPLATES)
def test_issue40_v_format_is_chosen_from_the_template(source: str, expected: str) -> None:
    assert select_tool_parser(source) == expected


