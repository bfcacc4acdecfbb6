"""Incremental detokenization: token ids arrive one step at a time, text leaves as soon as it is whole.

Decoding each token alone is wrong (a space-prefix or a multi-byte character spans tokens) and
re-decoding the whole sequence each step is quadratic. As vLLM and TGI do, we decode a short
window: the tokens already shown once (`prefix`) plus the new ones, and emit only the difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for an incomplete UTF-8 sequence
# How many prompt tokens to keep as context, so the first generated token decodes as it would
# inside the whole text (a SentencePiece leading space is not dropped).
CONTEXT_TOKENS = 4


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of token ids into text without ever emitting a broken character.

    `push` returns the text that became final; text whose decoded tail is U+FFFD (a character
    still missing bytes) is held until a later token completes it, or until `flush`.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        *,
        skip_special_tokens: bool = False,
        context_token_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(context_token_ids[-CONTEXT_TOKENS:]) if context_token_ids else []
        self._prefix_offset = 0  # start of the decode window in _ids
        self._read_offset = len(self._ids)  # tokens before this have had their text emitted

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly completed text ("" while a character is incomplete)."""
        self._ids.extend(token_ids)
        prefix_text, full_text = self._decode_window()
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._advance()
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """The text still held back at the end of the sequence (may contain U+FFFD if broken)."""
        prefix_text, full_text = self._decode_window()
        self._advance()
        return full_text[len(prefix_text) :]

    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        full_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=skip)
        return prefix_text, full_text

    def _advance(self) -> None:
        # The tokens just shown become the next window's context; older ones are never read again.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
