"""Token inputs for encoder models: tokenization with an explicit window, and padding.

Shared by the embedding and rerank providers (with `parse_dtype` for their configs). The checkpoint's tokenizer.json may carry
its own padding and truncation settings (all-MiniLM-L6-v2 pads to 128); both are turned
off, and the model window is applied here so an over-long input is either an error that
names the lengths or, when the caller asked, truncated.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Encoding, Tokenizer

from mlxcel.loading.errors import ModelLoadError


class InputError(ValueError):
    """A request input the provider cannot take; the server answers 400 with the message."""


class InputTooLongError(InputError):
    """An input longer than the model window, without truncation asked."""


@dataclass(frozen=True, slots=True)
class EncodedInput:
    """One model input: token ids and, for sentence pairs, their segment ids."""

    token_ids: list[int]
    type_ids: list[int] | None = None  # None = all segment 0


def load_tokenizer(folder: str | Path) -> Tokenizer:
    """tokenizer.json of an HF folder, without its stored padding and truncation."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: tokenizer.json not found (a fast tokenizer is required)")
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def model_window(folder: str | Path, max_position_embeddings: int) -> int:
    """Longest input in tokens: sentence-transformers' max_seq_length when declared.

    That is the length the model was trained and is served at by sentence-transformers
    (256 for all-MiniLM-L6-v2), never more than the position table holds.
    """
    path = Path(folder) / "sentence_bert_config.json"
    if not path.is_file():
        return max_position_embeddings
    declared = json.loads(path.read_text()).get("max_seq_length") or max_position_embeddings
    return min(int(declared), max_position_embeddings)


def encode_texts(
    tokenizer: Tokenizer,
    texts: Sequence[str],
    window: int,
    truncate: bool,
    indices: Sequence[int] | None = None,
) -> list[EncodedInput]:
    """Texts with the tokenizer's special tokens, each within `window` tokens.

    `indices` are the inputs' positions in the request, for error messages.
    """
    num_special = tokenizer.num_special_tokens_to_add(False)
    positions = range(len(texts)) if indices is None else indices
    encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    encoded = []
    for index, encoding in zip(positions, encodings, strict=True):
        _fit(encoding, window - num_special, num_special, truncate, index)
        encoded.append(EncodedInput(tokenizer.post_process(encoding).ids))
    return encoded


def encode_pairs(
    tokenizer: Tokenizer, query: str, documents: Sequence[str], window: int, truncate: bool
) -> list[EncodedInput]:
    """(query, document) pairs with segment ids; truncation shortens only the document."""
    num_special = tokenizer.num_special_tokens_to_add(True)
    query_encoding = tokenizer.encode(query, add_special_tokens=False)
    budget = window - num_special - len(query_encoding.ids)
    if budget < 1:
        raise InputTooLongError(
            f"the query has {len(query_encoding.ids)} tokens, which leaves no room for a document "
            f"in the model's window of {window} tokens"
        )
    pairs = []
    for index, doc in enumerate(tokenizer.encode_batch(list(documents), add_special_tokens=False)):
        _fit(doc, budget, num_special + len(query_encoding.ids), truncate, index, what="document")
        merged = tokenizer.post_process(query_encoding, doc)
        pairs.append(EncodedInput(merged.ids, merged.type_ids))
    return pairs


def _fit(
    encoding: Encoding, budget: int, num_extra: int, truncate: bool, index: int, what: str = "input"
) -> None:
    if len(encoding.ids) <= budget:
        return
    if not truncate:
        total = len(encoding.ids) + num_extra
        raise InputTooLongError(
            f"{what} {index} has {total} tokens, more than the model's window of "
            f"{budget + num_extra} tokens; shorten it or set \"truncate\": true"
        )
    encoding.truncate(budget)


def pad_batch(
    inputs: Sequence[EncodedInput], pad_id: int, device: str | torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, token_type_ids), each [batch, max_len]."""
    max_len = max(len(item.token_ids) for item in inputs)
    input_ids = torch.full((len(inputs), max_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(inputs), max_len), dtype=torch.long)
    type_ids = torch.zeros((len(inputs), max_len), dtype=torch.long)
    for row, item in enumerate(inputs):
        length = len(item.token_ids)
        input_ids[row, :length] = torch.tensor(item.token_ids)
        attention_mask[row, :length] = 1
        if item.type_ids is not None:
            type_ids[row, :length] = torch.tensor(item.type_ids)
    return input_ids.to(device), attention_mask.to(device), type_ids.to(device)


def parse_dtype(name: str) -> torch.dtype:
    """A config's dtype name ("float32", "float16", "bfloat16") as a torch dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ModelLoadError(f"unknown dtype {name!r} (float32, float16 or bfloat16)")
    return dtype
