"""Streaming tool-call parsers (V, issue 6): every split of the reply gives the same calls.

For each format the reply is fed in two pieces split at every character boundary, in three
pieces, and one character at a time. Each time: content outside calls is exactly preserved,
each call's name is emitted once (in order of index), and the argument fragments concatenate
to JSON equal to the expected arguments. Cut-off replies still yield parseable arguments.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from mlxcel.chat.events import ContentDelta, OutputEvent, ToolCallArguments, ToolCallEnd, ToolCallStart
from mlxcel.chat.tools import make_tool_parser, select_tool_parser
from mlxcel.chat.tools.base import collect_tool_calls, is_json_object

Call = tuple[str, dict[str, Any]]

CASES: list[tuple[str, str, str, list[Call]]] = [
    ("hermes", 'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": 1.5e3}}\n'
     '</tool_call>\n<tool_call>\n{"arguments": {"q": "a \\"quoted\\" <tool_call> \\u00e9"}, "name": "search"}\n'
     "</tool_call>", "Let me check.",
     [("get_weather", {"city": "Paris", "n": 1500.0}), ("search", {"q": 'a "quoted" <tool_call> é'})]),
    ("hermes", "No tools needed: 2 < 3 and <b>bold</b>.", "No tools needed: 2 < 3 and <b>bold</b>.", []),
    ("hermes", '<tool_call>\n{"type": "function", "function": {"name": "f", "arguments": "{\\"a\\": [1, null]}"}}'
     "\n</tool_call>\nDone.", "Done.", [("f", {"a": [1, None]})]),
    ("llama3", '{"name": "f", "parameters": {"a": [1, true, null], "b": {"c": -0.5e-3}}}; {"name": "g", '
     '"parameters": {}}', "", [("f", {"a": [1, True, None], "b": {"c": -0.5e-3}}), ("g", {})]),
    ("llama3", '<|python_tag|>{"name": "f", "arguments": {"x": "y"}}', "", [("f", {"x": "y"})]),
    ("llama3", 'The JSON is {"name": "f"}.', 'The JSON is {"name": "f"}.', []),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": '
     '{"b": "x,y"}}]', "Sure.", [("f", {"a": 1}), ("g", {"b": "x,y"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]noop[ARGS]{}', "",
     [("get_weather", {"city": "Paris"}), ("noop", {})]),
    ("generic", '```json\n{"tool_calls": [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]}\n```',
     "", [("f", {"a": 1}), ("g", {})]),
    ("generic", '{"tool_call": {"name": "f", "arguments": {"k": [[], {}]}}}', "", [("f", {"k": [[], {}]})]),
    ("generic", '[{"name": "f", "arguments": null}]', "", [("f", {})]),
    ("generic", "Plain answer, {not json}.", "Plain answer, {not json}.", []),
    ("generic", '```json\n{"name": 5, "size": [1]}\n```', '```json\n{"name": 5, "size": [1]}\n```', []),
    ("llama3", '{"type": "object", "properties": {}}', '{"type": "object", "properties": {}}', []),
]  # fmt: skip


def splits(text: str) -> Iterator[list[str]]:
    for at in range(len(text) + 1):
        yield [text[:at], text[at:]]
    for a in range(0, len(text) + 1, 5):
        for b in range(a, len(text) + 1, 7):
            yield [text[:a], text[a:b], text[b:]]
    yield list(text)


def run(fmt: str, pieces: list[str]) -> list[OutputEvent]:
    counter = iter(range(1000))
    parser = make_tool_parser(fmt, new_id=lambda: f"id{next(counter)}")
    events: list[OutputEvent] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def summarize(events: list[OutputEvent]) -> tuple[str, list[Call]]:
    """Content text, and each call's (name, parsed concatenated fragments; None for a call the reply's end cut
    off, whose fragments are what was written and never a made-up closing); checks the protocol."""
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [s.index for s in starts] == list(range(len(starts))), "indexes count up from 0, each once"
    fragments: dict[int, str] = {}
    for e in events:
        if isinstance(e, ToolCallArguments):
            assert e.index in {s.index for s in starts[: e.index + 1]}, "arguments come after their start"
            fragments[e.index] = fragments.get(e.index, "") + e.text
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [e.index for e in ends] == [s.index for s in starts]
    assert [e.arguments for e in ends] == [fragments.get(s.index, "") for s in starts]
    for end in ends:
        assert end.is_complete or not is_json_object(end.arguments), end
    complete = {e.index for e in ends if e.is_complete}
    return content, [(s.name, json.loads(fragments[s.index]) if s.index in complete else None) for s in starts]


@pytest.mark.parametrize(("fmt", "reply", "content", "calls"), CASES)
def test_v_every_split_gives_the_same_content_and_calls(fmt: str, reply: str, content: str, calls: list[Call]) -> None:
    for pieces in splits(reply):
        assert summarize(run(fmt, pieces)) == (content, calls), pieces


@pytest.mark.parametrize(("fmt", "reply", "content", "calls"), [c for c in CASES if c[3]])
def test_v_cut_off_replies_mark_the_cut_call_and_show_no_markup(
    fmt: str, reply: str, content: str, calls: list[Call]
) -> None:
    """Issue 46: a call the end cuts is not complete (its arguments are never closed or made up as "{}");
    every call finished before the cut parses as written."""
    for cut in range(len(reply) + 1):
        got_content, got_calls = summarize(run(fmt, [reply[:cut]]))
        if got_content.strip() in ("{", "["):
            continue  # a reply that is only "{" is text: nothing showed it was a call
        assert content.startswith(got_content.rstrip()), (cut, got_content)
        for (name, arguments), (want_name, want_arguments) in zip(got_calls, calls):
            assert name == want_name and arguments in (None, want_arguments), (cut, got_calls)
    assert summarize(run(fmt, [reply]))[1] == calls  # uncut: every call complete


def test_v_fragments_stream_before_the_call_ends() -> None:
    """Arguments arrive as the model writes them, not in one piece at the end."""
    reply = '<tool_call>\n{"name": "write", "arguments": {"text": "' + "word " * 20 + '"}}\n</tool_call>'
    events = run("hermes", list(reply))
    fragments = [e for e in events if isinstance(e, ToolCallArguments)]
    assert len(fragments) > 20
    assert isinstance(events[0], ToolCallStart) and events[0].name == "write"


def test_v_one_delta_gives_one_fragment_per_call() -> None:
    parser = make_tool_parser("hermes", new_id=lambda: "id")
    events = parser.feed('<tool_call>{"name": "f", "arguments": {"a": ') + parser.feed('"long text here"}}')
    fragments = [e.text for e in events if isinstance(e, ToolCallArguments)]
    assert fragments == ['{', '"a": "long text here"}']  # the key waits for its value


def test_v_raw_control_characters_in_strings_become_escapes() -> None:
    events = run("hermes", ['<tool_call>{"name": "f", "arguments": {"code": "a\n\tb"}}</tool_call>'])
    assert summarize(events)[1] == [("f", {"code": "a\n\tb"})]


def test_v_call_without_a_name_is_dropped_not_leaked() -> None:
    assert summarize(run("hermes", ['Hi <tool_call>{"arguments": {"a": 1}}</tool_call>'])) == ("Hi", [])


def test_v_collect_tool_calls_for_non_streaming_replies() -> None:
    events = run("hermes", [CASES[0][1]])
    calls = collect_tool_calls(events)
    assert [c.name for c in calls] == ["get_weather", "search"]
    assert [c.id for c in calls] == ["id0", "id1"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "n": 1500.0}


def test_v_mistral_ids_are_nine_alphanumerics() -> None:
    parser = make_tool_parser("mistral")
    events = parser.feed('[TOOL_CALLS][{"name": "f", "arguments": {}}]') + parser.finish()
    call_id = next(e.id for e in events if isinstance(e, ToolCallStart))
    assert len(call_id) == 9 and call_id.isalnum()


def test_v_openai_ids_look_like_openai_ids() -> None:
    parser = make_tool_parser("hermes")
    events = parser.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>') + parser.finish()
    call_id = next(e.id for e in events if isinstance(e, ToolCallStart))
    assert call_id.startswith("call_") and len(call_id) == 29


@pytest.mark.parametrize(("source", "expected"), [
    ("{% for m in messages %}<tool_call>{{ m }}</tool_call>{% endfor %}", "hermes"),
    ("{{ '[TOOL_CALLS]' }}{{ tools | tojson }}", "mistral"),
    ("<|start_header_id|>ipython<|end_header_id|>{{ '<|python_tag|>' }}", "llama3"),
    ("<|start_header_id|>user<|end_header_id|> Respond with {\"name\": ..., \"parameters\": ...}", "llama3"),
    ("<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>", "generic"),
    (None, "generic"),
])  # fmt: skip
def test_v_select_tool_parser_from_the_chat_template(source: str | None, expected: str) -> None:
    assert select_tool_parser(source) == expected


def test_v_unknown_format_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        make_tool_parser("xml")


# ---- issue 26 (V): a call naming an undeclared tool is text, never a call ----

DECLARED = ("get_weather", "noop")
UNDECLARED_CASES: list[tuple[str, str, str, list[Call]]] = [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_sunny_city", "arguments": {"x": 1}}\n</tool_call>',
     'Sure.\n<tool_call>\n{"name": "get_sunny_city", "arguments": {"x": 1}}\n</tool_call>', []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_location", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "get_location", "arguments": {}}\n</tool_call>', [("get_weather", {"city": "Rome"})]),
    ("hermes", '<tool_call>\n{"arguments": {"a": [1]}, "name": "improve_names"',
     '<tool_call>\n{"arguments": {"a": [1]}, "name": "improve_names"', []),  # cut off
    ("llama3", '{"name": "get_location", "parameters": {"q": 1}}', '{"name": "get_location", "parameters": {"q": 1}}',
     []),
    ("llama3", '<|python_tag|>{"name": "get_location", "parameters": {}}',
     '<|python_tag|>{"name": "get_location", "parameters": {}}', []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_location", "arguments": {}}]',
     '[TOOL_CALLS] [{"name": "get_location", "arguments": {}}]', []),
    ("mistral", '[TOOL_CALLS]get_location[ARGS]{"a": 1}', '[TOOL_CALLS]get_location[ARGS]{"a": 1}', []),
    ("mistral", '[TOOL_CALLS]noop[ARGS]{}[TOOL_CALLS]get_location[ARGS]{"a": 1}',
     '[TOOL_CALLS]get_location[ARGS]{"a": 1}', [("noop", {})]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {}}, {"name": "get_location", "arguments": {}}]',
     "", [("get_weather", {})]),  # a block with a declared call stays calls; the other is dropped
    ("generic", '```json\n{"tool_calls": [{"name": "get_sunny_city", "arguments": {}, "id": "call_1"}]}\n```',
     '```json\n{"tool_calls": [{"name": "get_sunny_city", "arguments": {}, "id": "call_1"}]}\n```', []),
    ("generic", '{"name": "Python", "arguments": {"command": "python3 hello.py"}}',
     '{"name": "Python", "arguments": {"command": "python3 hello.py"}}', []),
]  # fmt: skip


def run_declared(fmt: str, pieces: list[str]) -> list[OutputEvent]:
    counter = iter(range(1000))
    parser = make_tool_parser(fmt, new_id=lambda: f"id{next(counter)}", declared=DECLARED)
    events: list[OutputEvent] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


@pytest.mark.parametrize(("fmt", "reply", "content", "calls"), UNDECLARED_CASES)
def test_issue26_v_undeclared_tool_name_stays_text_in_every_format(
    fmt: str, reply: str, content: str, calls: list[Call]
) -> None:
    for pieces in splits(reply):
        assert summarize(run_declared(fmt, pieces)) == (content, calls), pieces


def test_issue26_v_without_declared_names_any_name_is_a_call() -> None:
    reply = '<tool_call>\n{"name": "get_sunny_city", "arguments": {}}\n</tool_call>'
    assert summarize(run("hermes", [reply])) == ("", [("get_sunny_city", {})])


# ---- issue 26 leftover: a Markdown ```json block holding a call to a declared tool is a call ----

WEATHER_BLOCK = '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'
PYTHON_BLOCK = '```json\n{"name": "Python", "arguments": {"command": "python3 hello.py"}}\n```'
FENCED_CASES: list[tuple[str, str, str, list[Call]]] = [
    ("hermes", f"I will check.\n{WEATHER_BLOCK}\nDone.", "I will check.Done.", [("get_weather", {"city": "Paris"})]),
    ("hermes", WEATHER_BLOCK, "", [("get_weather", {"city": "Paris"})]),
    ("hermes", PYTHON_BLOCK, PYTHON_BLOCK, []),  # MODELS.md's case: an undeclared name stays text
    ("hermes", f"Run it:\n{PYTHON_BLOCK}", f"Run it:\n{PYTHON_BLOCK}", []),
    ("hermes", '```JSON\n[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "noop", "arguments": {}}]\n```',
     "", [("get_weather", {"city": "Rome"}), ("noop", {})]),
    ("hermes", '```json\n{"name": "Alice", "age": 3}\n```', '```json\n{"name": "Alice", "age": 3}\n```', []),
    ("hermes", "```python\nprint('noop')\n```", "```python\nprint('noop')\n```", []),
    ("hermes", "Use ``` for code, e.g. ```js``` or ```", "Use ``` for code, e.g. ```js``` or ```", []),
    ("llama3", f"Sure.\n{WEATHER_BLOCK}", "Sure.", [("get_weather", {"city": "Paris"})]),
    ("mistral", f"Sure.\n{WEATHER_BLOCK}", "Sure.", [("get_weather", {"city": "Paris"})]),
    ("generic", f"Sure.\n```\n{{\"name\": \"noop\", \"arguments\": {{}}}}\n```\nOK", "Sure.OK", [("noop", {})]),
    ("generic", WEATHER_BLOCK, "", [("get_weather", {"city": "Paris"})]),  # the generic format's own opening
    ("hermes", '```json\n{"name": "get_weather", "arguments": {"city": "Par', "", [("get_weather", None)]),  # cut: not complete (issue 46)
    ("hermes", "Done.\n```", "Done.\n```", []),
    ("hermes", '```json\n{"na', "", []),  # cut while opening a call
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "reply", "content", "calls"), FENCED_CASES)
def test_issue26_fenced_json_call_to_a_declared_tool_is_a_call(
    fmt: str, reply: str, content: str, calls: list[Call]
) -> None:
    for pieces in splits(reply):
        assert summarize(run_declared(fmt, pieces)) == (content, calls), pieces


def test_issue26_fenced_json_block_without_declared_tools_is_text() -> None:
    assert summarize(run("hermes", [WEATHER_BLOCK])) == (WEATHER_BLOCK, [])


# ---- issue 46: Qwen2.5-Coder's tagless call: a reply opening with {"name": <a declared tool>, ...} is the call ----

BARE_WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
BARE_CASES: list[tuple[str, str, list[Call]]] = [
    (BARE_WEATHER, "", [("get_weather", {"city": "Paris"})]),
    (f"\n {BARE_WEATHER}\nDone.", "Done.", [("get_weather", {"city": "Paris"})]),  # text after the call is content
    (f'{BARE_WEATHER}\n{{"name": "noop", "arguments": {{}}}}', "", [("get_weather", {"city": "Paris"}), ("noop", {})]),
    (f'<tool_call>\n{BARE_WEATHER}\n</tool_call>\n{{"name": "noop", "arguments": {{}}}}', "",
     [("get_weather", {"city": "Paris"}), ("noop", {})]),  # a tagged call, then a bare one
    ('{"name": "Python", "arguments": {"command": "ls"}}', '{"name": "Python", "arguments": {"command": "ls"}}', []),
    (f"Sure: {BARE_WEATHER}", f"Sure: {BARE_WEATHER}", []),  # mid-text JSON is the model's text
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "get_weather", "arguments": {"city": "Par', "", [("get_weather", None)]),  # cut: not complete
    ('{"name": "get_we', "", []),  # cut before the tool's name was whole
    ("{", "{", []),
    (f"<|im_start|>\n{BARE_WEATHER}\n", "", [("get_weather", {"city": "Paris"})]),  # Claude Code run 15's reply
    (f"<|im_start|>assistant\n{BARE_WEATHER}", "", [("get_weather", {"city": "Paris"})]),
    ("<|im_start|>assistant\nHello", "<|im_start|>assistant\nHello", []),
    ("<|im_start|>", "<|im_start|>", []),
    ("<|im_st", "<|im_st", []),
]  # fmt: skip


@pytest.mark.parametrize(("reply", "content", "calls"), BARE_CASES)
def test_issue46_bare_json_call_to_a_declared_tool_is_a_call_in_hermes(reply: str, content: str,
                                                                      calls: list[Call]) -> None:
    for pieces in splits(reply):
        assert summarize(run_declared("hermes", pieces)) == (content, calls), pieces


def test_issue46_bare_json_without_declared_tools_is_text() -> None:
    assert summarize(run("hermes", [BARE_WEATHER])) == (BARE_WEATHER, [])
