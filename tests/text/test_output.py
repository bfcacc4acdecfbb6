"""TextAssembler: per-choice text from token ids, with stop strings and hidden end tokens."""

from __future__ import annotations

import pytest

from mlxcel.text.output import TextAssembler, TextStep
from mlxcel.text.tokenizer import Tokenizer


def test_sampling_assembler_stop_string_across_tokens(byte_level_tokenizer: Tokenizer) -> None:
    tok = byte_level_tokenizer
    ids = tok.encode("hello world! 世界", add_special_tokens=False)
    assembler = TextAssembler(tok, stops=["o wo"])
    steps = [assembler.push([i]) for i in ids]
    assert "".join(s.text for s in steps) == "hell"
    assert [s.stop for s in steps if s.stop] == ["o wo"]
    assert assembler.stop == "o wo" and assembler.is_stopped
    assert assembler.push([ids[0]]) == TextStep("")
    assert assembler.finish() == ""


def test_sampling_assembler_hides_end_tokens_and_flushes(byte_level_tokenizer: Tokenizer) -> None:
    tok = byte_level_tokenizer
    ids = [*tok.encode("hello 世", add_special_tokens=False), 1]  # ends with <|im_end|>
    assembler = TextAssembler(tok, stops=["世界"])
    text = "".join(assembler.push([i]).text for i in ids)
    assert text == "hello "  # "世" may still start the stop "世界"
    assert assembler.finish() == "世"
    assert assembler.stop is None


def test_sampling_assembler_shows_end_tokens_when_asked(byte_level_tokenizer: Tokenizer) -> None:
    tok = byte_level_tokenizer
    assembler = TextAssembler(tok, hidden_token_ids=())
    assert assembler.push([*tok.encode("hi", add_special_tokens=False), 1]).text == "hi<|im_end|>"


def test_sampling_assembler_stop_found_in_flushed_text(byte_level_tokenizer: Tokenizer) -> None:
    tok = byte_level_tokenizer
    ids = tok.encode("ab🤗", add_special_tokens=False)[:-1]  # unfinished emoji: held until finish
    assembler = TextAssembler(tok, stops=["\ufffd"])
    assert assembler.push(ids).text == ""
    assert assembler.finish() == "ab"
    assert assembler.stop == "\ufffd"


@pytest.mark.slow
def test_sampling_assembler_real_model(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("Paris is the capital of France.<|im_end|>", add_special_tokens=False)
    assembler = TextAssembler(tok, stops=["capital of"])
    text = "".join(assembler.push([i]).text for i in ids) + assembler.finish()
    assert text == "Paris is the "
    assembler = TextAssembler(tok)
    text = "".join(assembler.push([i]).text for i in ids) + assembler.finish()
    assert text == "Paris is the capital of France."
