"""Tokenizer (A2): ids equal transformers' conversion of the same GGUF, special tokens, errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlxcel.loading.errors import ModelLoadError
from mlxcel.text.gguf_vocab import merges_from_vocab
from mlxcel.text.tokenizer import FimTokenIds, ThinkMarkers, Tokenizer
from tests.text.conftest import tiny_byte_level_metadata, tiny_sentencepiece_metadata

# Unicode, emoji (incl. ZWJ sequences and flags), runs of spaces/newlines/tabs, digits, code,
# and special-token text of both models.
CORPUS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "\n\n\nmany\n\n newlines \n  \n\t\ttabs\r\nCRLF",
    "12345 1 22 333 4444 3.14159 -0.5e10 1,000,000",
    "  1  22    333",
    "héllo Ünïcödé — “quotes” ‘x’ … naïve façade",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "emoji 🤗😀 👨‍👩‍👧‍👦 🇫🇷 ❤️ 👍🏽",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    '{"key": [1, 2, {"nested": null}], "s": "a\\"b"}',
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "a<bos>b<eos>c<pad>d",
    "I'm sure you'll say it's fine, they've said we'd go",
    "zero\u200bwidth\u00a0nbsp ﬁ ligature Å Å",
    "   ",
    "",
    "<think>reasoning</think>answer",
]


def _assert_parity(ours: Tokenizer, reference: Any) -> None:
    for text in CORPUS:
        expected = reference.encode(text)
        assert ours.encode(text) == expected, text
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
        assert ours.decode(expected) == reference.decode(expected), text
        assert ours.decode(expected, skip_special_tokens=True) == reference.decode(
            expected, skip_special_tokens=True
        ), text


@pytest.mark.slow
def test_a2_smollm2_ids_equal_transformers_conversion(smollm2_tokenizer: Tokenizer, smollm2_reference: Any) -> None:
    _assert_parity(smollm2_tokenizer, smollm2_reference)


@pytest.mark.slow
def test_a2_gemma3_ids_equal_transformers_conversion(gemma3_tokenizer: Tokenizer, gemma3_reference: Any) -> None:
    _assert_parity(gemma3_tokenizer, gemma3_reference)


@pytest.mark.slow
def test_a2_smollm2_special_tokens(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    assert tok.vocab_size == 49152
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.eos_token_ids == {2, 0}  # <|im_end|> and <|endoftext|>
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # add_bos_token is false
    assert tok.encode("<|im_start|>") == [1]
    assert {0, 1, 2} <= tok.special_token_ids
    assert tok.think_markers is None
    # SmolLM2-135M has repo/file markers but no fill-in-the-middle tokens.
    assert tok.fim_token_ids == FimTokenIds(repo=3, sep=5)
    assert not tok.fim_token_ids.is_available


@pytest.mark.slow
def test_a2_gemma3_special_tokens(gemma3_tokenizer: Tokenizer) -> None:
    tok = gemma3_tokenizer
    assert (tok.bos_token, tok.eos_token) == ("<bos>", "<eos>")
    assert tok.encode("hi")[0] == tok.bos_token_id == 2  # add_bos_token is true
    assert tok.encode("hi", add_special_tokens=False)[0] != 2
    assert tok.eos_token_ids == {1, tok.token_to_id("<end_of_turn>")}
    assert tok.decode(tok.encode("a  b\n\nc")) == "<bos>a  b\n\nc"
    assert tok.decode(tok.encode("a  b"), skip_special_tokens=True) == "a  b"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_a2_token_bytes_concatenate_to_the_text(model: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(f"{model}_tokenizer")
    for text in CORPUS[:11]:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8"), text


@pytest.mark.slow
def test_a2_from_pretrained_dir_matches_the_reference(smollm2_reference: Any, tmp_path: Path) -> None:
    smollm2_reference.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    for text in CORPUS:
        assert tok.encode(text) == smollm2_reference.encode(text), text
    assert tok.eos_token == config["eos_token"] == "<|im_end|>"
    assert tok.eos_token_ids == {0, 2}


def test_a2_from_pretrained_dir_wordpiece() -> None:
    """A real HF folder (all-MiniLM-L6-v2): tokenizer.json's own post-processor adds [CLS]/[SEP]."""
    packaged = pytest.importorskip("mlxcel.loading.packaged")
    pytest.importorskip("all_minilm_l6_v2")
    folder = packaged.resolve_packaged("all-minilm-l6-v2")
    tok = Tokenizer.from_pretrained_dir(folder)
    ids = tok.encode("Hello world")
    assert tok.id_to_token(ids[0]) == "[CLS]" and tok.id_to_token(ids[-1]) == "[SEP]"
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"


def test_a2_from_pretrained_dir_applies_add_bos_flag(tmp_path: Path, byte_level_tokenizer: Tokenizer) -> None:
    byte_level_tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<|endoftext|>", "eos_token": {"content": "<|im_end|>"}, "add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert tok.encode("hello") == [0, *byte_level_tokenizer.encode("hello")]
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)


def test_a2_missing_or_broken_tokenizer_json_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_pretrained_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not a readable tokenizer.json"):
        Tokenizer.from_pretrained_dir(tmp_path)


def test_a2_unsupported_gguf_tokenizer_names_the_supported_ones() -> None:
    metadata = {**tiny_byte_level_metadata(), "tokenizer.ggml.model": "rwkv"}
    with pytest.raises(ModelLoadError, match=r"'rwkv' is not supported \(supported: gpt2, llama\)"):
        Tokenizer.from_gguf(metadata)


def test_a2_byte_level_added_tokens_and_markers(byte_level_tokenizer: Tokenizer) -> None:
    tok = byte_level_tokenizer
    assert tok.encode("hello world") == [tok.token_to_id("hello"), tok.token_to_id("Ġworld")]
    assert tok.encode("<think>hello</think><|im_end|>") == [2, tok.token_to_id("hello"), 3, 1]
    assert tok.think_markers == ThinkMarkers("<think>", "</think>")
    assert tok.special_token_ids == {0, 1}  # user-defined <think> is added but not special
    assert tok.decode([2, 1], skip_special_tokens=True) == "<think>"
    assert tok.eos_token_ids == {0, 1}


def test_a2_qwen2_pre_tokenizer_splits_digits_one_by_one(byte_level_tokenizer: Tokenizer) -> None:
    gpt2 = Tokenizer.from_gguf(tiny_byte_level_metadata(pre="gpt2"))
    assert gpt2.encode("123") == byte_level_tokenizer.encode("123")  # no digit merges either way
    pieces = byte_level_tokenizer.backend.pre_tokenizer.pre_tokenize_str("ab 123")
    assert [p for p, _ in pieces] == ["ab", "Ġ", "1", "2", "3"]
    gpt2_pieces = gpt2.backend.pre_tokenizer.pre_tokenize_str("ab 123")
    assert [p for p, _ in gpt2_pieces] == ["ab", "Ġ123"]


def test_a2_sentencepiece_merges_follow_scores_and_byte_fallback(sentencepiece_tokenizer: Tokenizer) -> None:
    tok = sentencepiece_tokenizer
    assert tok.encode("hello world") == [1, tok.token_to_id("▁hello"), tok.token_to_id("▁world")]
    ids = tok.encode("hé", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["▁", "h", "<0xC3>", "<0xA9>"]
    assert tok.decode(tok.encode("hello héllo 世界", add_special_tokens=False)) == "hello héllo 世界"
    assert tok.decode(tok.encode("hello héllo 世界"), skip_special_tokens=True) == "hello héllo 世界"
    assert tok.decode(tok.encode("hello world"), skip_special_tokens=True) == "hello world"
    assert tok.token_bytes(tok.token_to_id("▁hello")) == b" hello"
    assert tok.token_bytes(tok.token_to_id("<0xC3>")) == b"\xc3"


def test_a2_merges_from_vocab_order() -> None:
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5}
    ranks = {"a": 0.0, "b": 0.0, "c": 0.0, "ab": -1.0, "bc": -2.0, "abc": -0.5}
    # Best rank first; for "abc" the longer left piece ("ab" + "c") comes before "a" + "bc".
    assert merges_from_vocab(vocab, ranks) == [("ab", "c"), ("a", "bc"), ("a", "b"), ("b", "c")]


def test_a2_fim_ids_from_gguf_keys_win_over_spellings() -> None:
    metadata = tiny_sentencepiece_metadata()
    metadata["tokenizer.ggml.fim_pre_token_id"] = 5
    metadata["tokenizer.ggml.fim_suf_token_id"] = 6
    metadata["tokenizer.ggml.fim_mid_token_id"] = 7
    fim = Tokenizer.from_gguf(metadata).fim_token_ids
    assert (fim.prefix, fim.suffix, fim.middle, fim.pad) == (5, 6, 7, None)
    assert fim.is_available
