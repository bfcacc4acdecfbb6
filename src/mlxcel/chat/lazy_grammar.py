"""A grammar that waits for its trigger (issue 26): under `tool_choice: auto` the reply is free
text until the model opens a tool call, then the call grammar takes over, as llama.cpp's lazy
grammars do; llguidance itself has no triggers, so this processor holds them.

    lazy = compiler.triggered_tool_calls(fmt, tools, choice, parallel=...)   # chat/grammar.py
    processor = make_lazy_processor(compiler, lazy, think=..., starts_in_reasoning=...)

The trigger is looked for in the reply's decoded text, not in token ids, so an opener split over
several tokens, or sharing a token with the text before or after it, is found all the same: the
text after the match (the rest of the token that completed it) is fed to the matcher as tokens
before it masks the next step. Reasoning is never scanned. Once the grammar completes the reply
is free again (the next call re-arms it), or ends when only one call is allowed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import llguidance
import torch

from mlxcel.chat.grammar import GrammarCompiler, GrammarProcessor, LazyGrammar, copies_compiler
from mlxcel.chat.reasoning import ThinkTokens, ThinkTracker
from mlxcel.text.detokenizer import IncrementalDetokenizer
from mlxcel.text.tokenizer import Tokenizer
from mlxcel.types import FinishReason

log = logging.getLogger(__name__)

# How far back in the text a trigger match may start; longer than any opener (a pattern
# anchored at the reply's start, `\A`, therefore matches only within the first this many characters).
LOOKBACK_CHARS = 64


class LazyGrammarProcessor:
    """A TokenProcessor: no mask until the trigger matches the reply's text, then the grammar's."""

    def __init__(
        self, inner: GrammarProcessor, tokenizer: Tokenizer, lazy: LazyGrammar, tracker: ThinkTracker | None
    ) -> None:
        self._inner = inner
        self._tokenizer = tokenizer
        self._lazy = lazy
        self._tracker = tracker
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._text = ""  # the reply's text after any reasoning
        self._scan_from = 0  # a trigger match starts here or later (after the last constrained part)
        self.is_constrained = False

    def __reduce__(self) -> tuple:
        """A fresh copy for the engine process (issue 25), over that process's tokenizer."""
        return _rebuilt_lazy, (self._inner, self._lazy, self._tracker)

    def process(self, logits: torch.Tensor, output_ids: Sequence[int]) -> None:
        if self.is_constrained:
            self._inner.process(logits, output_ids)

    def fill_mask(self, words: torch.Tensor) -> bool:
        return self.is_constrained and self._inner.fill_mask(words)

    def accept(self, token_id: int) -> FinishReason | None:
        if self._tracker is not None and self._tracker.advance(token_id):
            return None  # reasoning: never scanned, never constrained
        if token_id in self._tokenizer.eos_token_ids:
            return None  # the engine ends the reply
        seen = len(self._text)
        self._text += self._detokenizer.push([token_id])
        if self.is_constrained:
            return self._release() if self._inner.accept(token_id) is not None else None
        self._look_for_trigger(seen)
        return None

    def _look_for_trigger(self, seen: int) -> None:
        match = self._lazy.trigger.search(self._text, max(self._scan_from, seen - LOOKBACK_CHARS))
        if match is None:
            return
        self.is_constrained = True
        matcher = self._inner.matcher
        # The token that completed the opener may carry text past it: the grammar must see it first.
        for token in self._tokenizer.encode(self._text[match.end() :], add_special_tokens=False):
            if not matcher.consume_token(token):
                log.debug("the text after a tool-call opener does not fit the call grammar: %s", matcher.get_error())
                self._release()
                return
        if matcher.is_stopped():
            self._release()

    def _release(self) -> FinishReason | None:
        """The constrained part is over: free text again, or the end when only one call may come."""
        self.is_constrained = False
        self._inner.matcher.reset()
        self._scan_from = len(self._text)
        return None if self._lazy.is_repeatable else FinishReason.STOP


def make_lazy_processor(
    compiler: GrammarCompiler, lazy: LazyGrammar, *, think: ThinkTokens | None = None,
    starts_in_reasoning: bool = False,
) -> LazyGrammarProcessor:
    """A fresh processor for one choice (the matcher is built now, off the engine thread)."""
    matcher = llguidance.LLMatcher(compiler.llg_tokenizer, lazy.grammar.text, log_level=0)
    inner = GrammarProcessor(matcher, compiler.tokenizer.eos_token_ids, None, source=lazy.grammar.text)
    tracker = ThinkTracker(think, starts_in_reasoning=starts_in_reasoning) if think is not None else None
    return LazyGrammarProcessor(inner, compiler.tokenizer, lazy, tracker)


def _rebuilt_lazy(inner: GrammarProcessor, lazy: LazyGrammar, tracker: ThinkTracker | None) -> LazyGrammarProcessor:
    return LazyGrammarProcessor(inner, copies_compiler().tokenizer, lazy, tracker)
