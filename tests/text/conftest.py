"""Tokenizers of the real model files and tiny hand-built vocabularies for the text-layer tests.

The real models' fixtures (`smollm2_path`, `gemma3_path`, their GGUF metadata, our tokenizers and transformers'
ones: `*_metadata`, `*_tokenizer`, `*_reference`) are the root conftest's session fixtures, built once per run."""

from __future__ import annotations

from typing import Any

import pytest

from mlxcel.text.gguf_vocab import byte_alphabet
from mlxcel.text.tokenizer import Tokenizer

# --- tiny vocabularies (fast tests) ---------------------------------------------------------

CONTROL, USER_DEFINED, BYTE, NORMAL = 3, 4, 6, 1


def tiny_byte_level_metadata(pre: str = "qwen2") -> dict[str, Any]:
    """A byte-level BPE vocab: 4 added tokens, the 256 byte characters and a few merges."""
    specials = ["<|endoftext|>", "<|im_end|>", "<think>", "</think>"]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
    alphabet = [byte_alphabet()[b] for b in range(256)]
    tokens = [*specials, *alphabet, *(m.replace(" ", "") for m in merges)]
    types = [CONTROL, CONTROL, USER_DEFINED, USER_DEFINED] + [NORMAL] * (len(tokens) - 4)
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.eot_token_id": 1,
        "tokenizer.ggml.add_bos_token": False,
    }


def tiny_sentencepiece_metadata() -> dict[str, Any]:
    """A SentencePiece vocab with byte-fallback tokens and pieces scored best-first."""
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello", "▁hello", "▁w",
              "or", "▁wor", "▁worl", "▁world"]  # fmt: skip
    tokens = [*specials, *byte_tokens, *pieces]
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))]
    types = [2, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces)
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


@pytest.fixture(scope="session")
def byte_level_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(tiny_byte_level_metadata())


@pytest.fixture(scope="session")
def sentencepiece_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(tiny_sentencepiece_metadata())
