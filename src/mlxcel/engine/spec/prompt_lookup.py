"""Prompt lookup (B2): drafts copied from the request's own context, no checkpoint.

The longest suffix n-gram (n = ngram_size down to 1) of prompt + output so far is looked up in
the earlier context; the tokens that followed its most recent earlier occurrence are the draft.
Input-grounded tasks (rewrite, edit, quote) repeat long spans, so the drafts are often right.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mlxcel.engine.spec import Sequence


def lookup_draft(tokens: list[int] | np.ndarray, ngram_size: int, max_len: int) -> tuple[int, ...]:
    """The continuation of the latest earlier occurrence of the longest matching suffix n-gram."""
    context = np.asarray(tokens, dtype=np.int64)
    length = len(context)
    for n in range(min(ngram_size, length - 1), 0, -1):
        suffix = context[length - n:]
        # Windows that start before the suffix itself, so each has at least one token after it.
        windows = np.lib.stride_tricks.sliding_window_view(context[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tuple(context[start:start + max_len].tolist())
    return ()


class PromptLookupDrafter:
    """Stateless: every draft is computed from the sequence's tokens."""

    kind = "prompt-lookup"

    def __init__(self, ngram_size: int) -> None:
        self.ngram_size = ngram_size

    def propose(self, seq: Sequence, max_len: int) -> tuple[int, ...]:
        return lookup_draft(seq.token_ids, self.ngram_size, max_len)

    def free(self, request_id: str) -> None:
        return None
