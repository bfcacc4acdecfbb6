"""Token ids to API text for one generated sequence: detokenize, then cut at stop strings.

Every protocol adapter (OpenAI, Anthropic, llama-server) drives one `TextAssembler` per choice
with the `token_ids` of each TokenEvent, and ends it with `finish()`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mlxcel.text.detokenizer import IncrementalDetokenizer
from mlxcel.text.stop import StopMatcher
from mlxcel.text.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class TextStep:
    """The text one push made final, and the stop string matched in it (then the text ends)."""

    text: str
    stop: str | None = None


class TextAssembler:
    """Detokenizer + stop matcher for one sequence.

    Tokens in `hidden_token_ids` (by default the tokenizer's end-of-sequence tokens) produce no
    text: an `<|im_end|>` that ends generation is not part of the answer. After a stop string
    matches, later pushes return empty steps; the caller should abort the request.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        stops: Sequence[str] = (),
        skip_special_tokens: bool = False,
        hidden_token_ids: Iterable[int] | None = None,
        context_token_ids: Sequence[int] = (),
    ) -> None:
        hidden = tokenizer.eos_token_ids if hidden_token_ids is None else hidden_token_ids
        self._hidden = frozenset(hidden)
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=skip_special_tokens, context_token_ids=context_token_ids
        )
        self._stops = StopMatcher(stops)

    @property
    def stop(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stops.matched

    @property
    def is_stopped(self) -> bool:
        return self._stops.is_stopped

    def push(self, token_ids: Sequence[int]) -> TextStep:
        """Feed one event's token ids; return the text safe to stream now."""
        if self._stops.is_stopped:
            return TextStep("")
        visible = [t for t in token_ids if t not in self._hidden]
        text, stop = self._stops.push(self._detokenizer.push(visible)) if visible else ("", None)
        return TextStep(text, stop)

    def finish(self) -> str:
        """The remaining text at the end of the sequence (held-back bytes and partial stops)."""
        if self._stops.is_stopped:
            return ""
        text, _ = self._stops.push(self._detokenizer.flush())
        return text + self._stops.flush()
