"""Stop strings and call limits in the output parsers (R, V): stops match the answer, never the
reasoning; parallel_tool_calls false keeps the first call; a raw completion's stop strings spare
a budgeted reasoning block, at every split of the streamed text."""

from __future__ import annotations

import json

import pytest

from mlxcel.chat.output import ChatOutputParser
from mlxcel.chat.completion_output import CompletionOutputParser
from mlxcel.chat.events import ContentDelta, OutputEvent, ReasoningDelta, ToolCallEnd
from mlxcel.chat.reasoning import ThinkTokens
from mlxcel.chat.tools import make_tool_parser

THINK = ThinkTokens("<think>", "</think>", (1,), (2,))
TWO_CALLS = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
             '<tool_call>{"name": "b", "arguments": {}}</tool_call>')


def run(parser: ChatOutputParser | CompletionOutputParser, text: str, step: int) -> list[OutputEvent]:
    events: list[OutputEvent] = []
    for at in range(0, len(text), step):
        events += parser.feed(text[at:at + step])
        if parser.stop is not None:
            break
    return events + parser.finish()


def joined(events: list[OutputEvent], kind: type) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


@pytest.mark.parametrize("step", [1, 3, 100])
def test_r_chat_stops_skip_the_reasoning(step: int) -> None:
    parser = ChatOutputParser(think=THINK, starts_in_reasoning=True, stops=["STOP", "Paris"])
    events = run(parser, "Paris, STOP thinking.</think>It is Paris.", step)
    assert joined(events, ReasoningDelta) == "Paris, STOP thinking."
    assert joined(events, ContentDelta) == "It is " and parser.stop == "Paris"


@pytest.mark.parametrize("step", [1, 7, 200])
def test_v_parallel_tool_calls_false_keeps_the_first_call(step: int) -> None:
    one = ChatOutputParser(think=None, tool_parser=make_tool_parser("hermes"), max_tool_calls=1)
    ends = [e for e in run(one, TWO_CALLS, step) if isinstance(e, ToolCallEnd)]
    assert [(e.name, json.loads(e.arguments)) for e in ends] == [("a", {"x": 1})]
    assert [c.name for c in one.result().tool_calls] == ["a"]
    both = ChatOutputParser(think=None, tool_parser=make_tool_parser("hermes"))
    assert [c.name for c in (run(both, TWO_CALLS, step), both.result())[1].tool_calls] == ["a", "b"]


@pytest.mark.parametrize("step", [1, 2, 5, 100])
@pytest.mark.parametrize("primed", [True, False])
def test_r_completion_stops_spare_the_reasoning_block(step: int, primed: bool) -> None:
    opening = "" if primed else " <think>"
    parser = CompletionOutputParser(THINK, starts_in_reasoning=primed, stops=["</think>"])
    events = run(parser, opening + "thinking</think>\n\nanswer </think> more", step)
    # The raw text, block and end marker included, cut at the answer's own stop string.
    assert joined(events, ContentDelta) == opening + "thinking</think>\n\nanswer "
    assert parser.stop == "</think>"


@pytest.mark.parametrize("step", [1, 4])
def test_r_completion_without_a_block_matches_everything(step: int) -> None:
    parser = CompletionOutputParser(THINK, starts_in_reasoning=False, stops=["</think>"])
    assert joined(run(parser, "  plain </think> text", step), ContentDelta) == "  plain "
    plain = CompletionOutputParser(None, starts_in_reasoning=False, stops=["x"])
    assert joined(run(plain, "abcxdef", step), ContentDelta) == "abc" and plain.result().content == "abc"
