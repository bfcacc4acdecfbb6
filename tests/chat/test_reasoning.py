"""Reasoning markers and the streaming reasoning/content split (Q, R, issue 6).

The splitter must give the same reasoning and content however the text is cut into deltas,
must never show a partial marker, and must follow llama-server's --reasoning-format modes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlxcel.chat.output import ChatOutputParser
from mlxcel.chat.events import ContentDelta, ReasoningDelta, ToolCallArguments, ToolCallStart
from mlxcel.chat.reasoning import (
    ReasoningFormat, ReasoningSplitter, ThinkTokens, ThinkTracker, infer_think_tokens, is_primed,
    strip_think_blocks,
)  # fmt: skip
from mlxcel.text.tokenizer import Tokenizer
from mlxcel.chat.tools import make_tool_parser
from tests.text.conftest import tiny_byte_level_metadata

MARKERS = ("<think>", "</think>")


def split_all_ways(text: str, **options: Any) -> set[tuple[str, str]]:
    """(reasoning, content) for every two-piece split and for one character at a time."""
    results = set()
    pieces_list = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in pieces_list:
        splitter = ReasoningSplitter(MARKERS, **options)
        events = [e for p in pieces for e in splitter.feed(p)] + splitter.finish()
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        assert "</th" not in content or "</think>" in content, pieces
        results.add((reasoning, content))
    return results


@pytest.mark.parametrize(("text", "primed", "expected"), [
    ("<think>\nLet me think. a </th b\n</think>\n\nThe answer.", False, ("Let me think. a </th b", "The answer.")),
    ("  step one\nstep two\n</think>\n\nFinal.", True, ("step one\nstep two", "Final.")),
    ("Just an answer <think>not reasoning</think>", False, ("", "Just an answer <think>not reasoning</think>")),
    ("<think>cut off mid thought", False, ("cut off mid thought", "")),
    ("<thi", False, ("", "<thi")),
    ("\n\n<think>x</think>y", False, ("x", "y")),
])  # fmt: skip
def test_q_splitter_streams_the_same_split_however_deltas_are_cut(
    text: str, primed: bool, expected: tuple[str, str]
) -> None:
    assert split_all_ways(text, starts_in_reasoning=primed) == {expected}


def test_q_reasoning_streams_before_the_block_closes() -> None:
    splitter = ReasoningSplitter(MARKERS, starts_in_reasoning=True)
    first = splitter.feed("I am thinking ")
    assert first == [ReasoningDelta("I am thinking")]  # trailing space held: it may precede </think>
    assert splitter.feed("hard") == [ReasoningDelta(" hard")]


def test_r_format_none_keeps_the_block_in_content() -> None:
    assert split_all_ways("<think>a</think>b", reasoning_format=ReasoningFormat.NONE) == {("", "<think>a</think>b")}


def test_r_format_deepseek_legacy_streams_inline_and_still_extracts() -> None:
    splitter = ReasoningSplitter(MARKERS, reasoning_format=ReasoningFormat.DEEPSEEK_LEGACY, starts_in_reasoning=True)
    events = splitter.feed("abc</think>") + splitter.feed("Answer") + splitter.finish()
    assert all(isinstance(e, ContentDelta) for e in events)
    assert "".join(e.text for e in events) == "<think>abc</think>Answer"
    assert splitter.reasoning_text == "abc"


def test_r_reasoning_format_parse() -> None:
    assert ReasoningFormat.parse("DeepSeek-Legacy") is ReasoningFormat.DEEPSEEK_LEGACY
    with pytest.raises(ValueError, match="must be one of none, auto, deepseek, deepseek-legacy"):
        ReasoningFormat.parse("qwen")


def test_q_primed_detection_from_the_rendered_prompt() -> None:
    think = ThinkTokens("<think>", "</think>", (1,), (2,))
    assert is_primed("<|im_start|>assistant\n<think>\n", think)
    assert not is_primed("<|im_start|>assistant\n<think>\n\n</think>\n\n", think)
    assert not is_primed("<|im_start|>assistant\n", think)
    assert not is_primed("<think>\n", None)


def test_s_infer_think_tokens_single_and_multi_token(byte_level_tokenizer: Tokenizer) -> None:
    think = infer_think_tokens(byte_level_tokenizer)
    assert think is not None and (think.start, think.end) == MARKERS
    assert len(think.start_ids) == 1 and len(think.end_ids) == 1
    metadata = tiny_byte_level_metadata()
    metadata["tokenizer.ggml.tokens"] = [*metadata["tokenizer.ggml.tokens"][:2], "<|channel>", "<channel|>",
                                         *metadata["tokenizer.ggml.tokens"][4:]]
    gemma4_like = infer_think_tokens(Tokenizer.from_gguf(metadata))
    assert gemma4_like is not None and gemma4_like.start == "<|channel>thought"
    assert len(gemma4_like.start_ids) > 1 and len(gemma4_like.end_ids) == 1


def test_s_no_markers_without_think_tokens(sentencepiece_tokenizer: Tokenizer) -> None:
    assert infer_think_tokens(sentencepiece_tokenizer) is None


def test_r_tracker_counts_reasoning_tokens_without_markers() -> None:
    think = ThinkTokens("<a>", "</a>", (7, 8), (9, 10))
    tracker = ThinkTracker(think, starts_in_reasoning=False)
    assert [tracker.advance(t) for t in (7, 8, 1, 9, 2, 9)] == [True] * 6
    assert tracker.phase == ThinkTracker.REASONING and tracker.num_reasoning_tokens == 3
    assert tracker.advance(10) and tracker.phase == ThinkTracker.AFTER
    assert not tracker.advance(5)
    other = ThinkTracker(think, starts_in_reasoning=False)
    assert not other.advance(1) and other.phase == ThinkTracker.AFTER


def test_s_strip_think_blocks() -> None:
    assert strip_think_blocks("<think>a</think>\n\nB <think>c</think> D", MARKERS) == "B D"
    assert strip_think_blocks("primed reasoning</think>\n\nAnswer", MARKERS) == "Answer"
    assert strip_think_blocks("no blocks", MARKERS) == "no blocks"


def test_v_chat_output_reasoning_then_tool_calls() -> None:
    think = ThinkTokens("<think>", "</think>", (1,), (2,))
    reply = ('<think>\nThe user wants weather.\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", '
             '"arguments": {"city": "Paris"}}\n</tool_call>')
    for step in (1, 4, len(reply)):
        parser = ChatOutputParser(think=think, tool_parser=make_tool_parser("hermes"))
        events = [e for i in range(0, len(reply), step) for e in parser.feed(reply[i : i + step])]
        events += parser.finish()
        result = parser.result()
        assert result.reasoning == "The user wants weather."
        assert result.content == "Checking."
        assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [("get_weather", {"city": "Paris"})]
        assert sum(isinstance(e, ToolCallStart) for e in events) == 1
        args = "".join(e.text for e in events if isinstance(e, ToolCallArguments))
        assert json.loads(args) == {"city": "Paris"}
        assert parser.finish() == []  # finishing twice adds nothing
        assert result.finish_reason("stop") == "tool_calls"
        assert result.finish_reason("length") == "length"
