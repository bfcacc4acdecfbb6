"""llama-server native `POST /tokenize` and `POST /detokenize` (F4).

`/tokenize` answers `{"tokens": [ids]}`, or with `with_pieces` `{"tokens": [{"id", "piece"}]}` where
a piece is its text, or its byte values when they are not valid UTF-8 on their own (one byte
of a multi-byte character). `add_special` adds BOS where the model's configuration does;
`parse_special: false` reads special-token text such as `<|im_start|>` as plain text.
"""

from __future__ import annotations

import weakref
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from mlxcel.api.errors import invalid_request
from mlxcel.api.llama_server.schemas import DetokenizeRequest, TokenizeRequest
from mlxcel.api.replies import JsonReply
from mlxcel.api.schema import validate_body
from mlxcel.text.tokenizer import Tokenizer

# NOTE: `encode_special_tokens` is a setting of the whole backend, so plain-text encoding uses a
# private copy per served tokenizer rather than flipping the shared one between requests.
_PLAIN_TEXT_COPIES: weakref.WeakKeyDictionary[Tokenizer, BackendTokenizer] = weakref.WeakKeyDictionary()


def parse_tokenize_request(body: Any) -> TokenizeRequest:
    return validate_body(TokenizeRequest, body)


def parse_detokenize_request(body: Any) -> DetokenizeRequest:
    return validate_body(DetokenizeRequest, body)


def tokenize_content(tokenizer: Tokenizer, req: TokenizeRequest) -> JsonReply:
    """The token ids of `content`, with their pieces when asked."""
    backend = tokenizer.backend if req.parse_special else _plain_text_backend(tokenizer)
    ids = backend.encode(req.content, add_special_tokens=req.add_special).ids
    if not req.with_pieces:
        return JsonReply({"tokens": ids})
    return JsonReply({"tokens": [{"id": i, "piece": piece(tokenizer, i)} for i in ids]})


def detokenize_tokens(tokenizer: Tokenizer, req: DetokenizeRequest) -> JsonReply:
    """The text of `tokens`, special tokens included (as llama-server renders them)."""
    for k, token_id in enumerate(req.tokens):
        if not 0 <= token_id < tokenizer.vocab_size:
            raise invalid_request(f"tokens.{k}: token id {token_id} is outside the vocabulary "
                                  f"(0..{tokenizer.vocab_size - 1})")
    return JsonReply({"content": tokenizer.decode(req.tokens)})


def piece(tokenizer: Tokenizer, token_id: int) -> str | list[int]:
    """The token's text, or its bytes when they are not valid UTF-8 by themselves."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _plain_text_backend(tokenizer: Tokenizer) -> BackendTokenizer:
    copy = _PLAIN_TEXT_COPIES.get(tokenizer)
    if copy is None:
        copy = BackendTokenizer.from_str(tokenizer.backend.to_str())
        copy.encode_special_tokens = True
        _PLAIN_TEXT_COPIES[tokenizer] = copy
    return copy
