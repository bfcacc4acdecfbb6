"""Incremental detokenizer: never a broken character, same text as a full decode, small windows."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from mlxcel.text.detokenizer import IncrementalDetokenizer
from mlxcel.text.tokenizer import Tokenizer

TEXTS = [
    "hello world",
    "世界 🤗 👨‍👩‍👧‍👦 naïve — ok",
    "日本語のテキスト、中文文本。한국어 🇫🇷❤️",
    "  spaces   and\n\nnewlines\t\t end ",
]


class CountingDecoder:
    """Wraps a tokenizer and records how many ids each decode call received."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.window_sizes: list[int] = []

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        self.window_sizes.append(len(token_ids))
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def _stream(tokenizer: Tokenizer, ids: list[int], step: int = 1, **kwargs: bool) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    chunks = [detok.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    return [*chunks, detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_sampling_detokenizer_never_emits_a_broken_character(
    text: str, kind: str, request: pytest.FixtureRequest
) -> None:
    """Emoji and CJK split over byte-level tokens and over byte-fallback tokens."""
    tok: Tokenizer = request.getfixturevalue(f"{kind}_tokenizer")
    ids = tok.encode(text, add_special_tokens=False)
    for step in (1, 2, 3):
        chunks = _stream(tok, ids, step)
        assert not any("\ufffd" in c for c in chunks)
        assert "".join(chunks) == tok.decode(ids)
    # The SentencePiece (Metaspace) decoder drops one leading space, as transformers' does.
    expected = text[1:] if kind == "sentencepiece" and text.startswith(" ") else text
    assert tok.decode(ids) == expected


def test_sampling_detokenizer_holds_a_partial_character_until_complete(byte_level_tokenizer: Tokenizer) -> None:
    tok = byte_level_tokenizer
    ids = tok.encode("🤗", add_special_tokens=False)
    assert len(ids) == 4  # one token per UTF-8 byte
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids] == ["", "", "", "🤗"]
    assert detok.flush() == ""


def test_sampling_detokenizer_flush_returns_an_unfinished_tail(byte_level_tokenizer: Tokenizer) -> None:
    tok = byte_level_tokenizer
    ids = tok.encode("a🤗", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids) == ""  # "a" + three of four bytes: the decoded tail is U+FFFD
    assert detok.flush() == tok.decode(ids)


def test_sampling_detokenizer_decodes_a_small_window(byte_level_tokenizer: Tokenizer) -> None:
    """O(1) per token: each decode sees the last shown token(s) plus the new ones, not the whole text."""
    counter = CountingDecoder(byte_level_tokenizer)
    ids = byte_level_tokenizer.encode("hello world 世界 " * 50, add_special_tokens=False)
    detok = IncrementalDetokenizer(counter)
    text = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert text == byte_level_tokenizer.decode(ids)
    # At most the last shown character's tokens plus the pending ones (3-byte CJK here).
    assert len(ids) > 400 and max(counter.window_sizes) <= 6


def test_sampling_detokenizer_skips_special_tokens(byte_level_tokenizer: Tokenizer) -> None:
    tok = byte_level_tokenizer
    ids = [*tok.encode("hello", add_special_tokens=False), 1, *tok.encode(" world", add_special_tokens=False)]
    assert "".join(_stream(tok, ids)) == "hello<|im_end|> world"
    assert "".join(_stream(tok, ids, skip_special_tokens=True)) == "hello world"


def test_sampling_detokenizer_context_keeps_the_leading_space(sentencepiece_tokenizer: Tokenizer) -> None:
    tok = sentencepiece_tokenizer
    prompt = tok.encode("hello")
    world = tok.encode("hello world", add_special_tokens=False)[1:]
    assert tok.decode(world) == "world"  # alone, the Metaspace decoder drops the space
    detok = IncrementalDetokenizer(tok, context_token_ids=prompt)
    assert detok.push(world) + detok.flush() == " world"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_sampling_detokenizer_real_models(model: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(f"{model}_tokenizer")
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        chunks = _stream(tok, ids)
        assert not any("\ufffd" in c for c in chunks), text
        assert "".join(chunks) == tok.decode(ids) == text
