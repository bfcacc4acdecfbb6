"""Speculative decoding (B1-B4): draft kinds behind one small interface.

A `Drafter` proposes up to N tokens that may follow a sequence; the scheduler asks for a draft
only for decode rows and only while at most `--prompt-lookup-max-batch` rows run (B4). The
target then checks the draft in its ordinary decode step (k + 1 single-token rows of the same
sequence, engine/runner.py), so each position's logits have the bits plain decoding would give,
and the scheduler accepts tokens one at a time with the target's own sampler (B4 exactness).

Drafts here are point masses (copied n-grams, a greedy draft model); for a point-mass draft q
the rejection-sampling rule (accept d with probability min(1, p(d) / q(d)) = p(d), else draw
from max(0, p - q) renormalised = p without d) is the same law as "draw x from p, accept while
x == d", which is what the scheduler does: the output distribution is exactly the target's,
and a seeded request draws its generator once per emitted token, as plain decoding does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

import torch
from torch import nn

from mlxcel.config import SpeculativeConfig

log = logging.getLogger(__name__)


def weights_misfit(module: nn.Module, weights: Mapping[str, torch.Tensor]) -> str | None:
    """Load a drafter's `weights` into `module`; what does not fit, in words, or None.

    Rotary tables are computed, not stored, so their absence is fine; a tensor of the wrong
    shape is a misfit like a missing or unexpected name."""
    try:
        missing, unexpected = module.load_state_dict(dict(weights), strict=False)
    except RuntimeError as exc:  # a shape that does not fit
        return str(exc)
    missing = [name for name in missing if not name.startswith("rotary.")]
    if missing or unexpected:
        return f"missing {missing[:4]}, unexpected {unexpected[:4]}"
    return None


class Sequence(Protocol):
    """What a drafter reads of a running sequence (engine/scheduler.py's Sequence has it)."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int  # positions whose KV the target holds (the next token sits at this one)


class Drafter(Protocol):
    """Proposes draft tokens for one sequence; owns whatever per-request state it keeps."""

    kind: str

    def propose(self, seq: Sequence, max_len: int) -> tuple[int, ...]:
        """Up to `max_len` tokens that may follow `seq.token_ids` (may be empty)."""
        ...

    def free(self, request_id: str) -> None:
        """Forget a finished, aborted or preempted request (its draft KV, if any)."""
        ...


class NoDrafter:
    """Speculation off: every row decodes one token a step."""

    kind = "none"

    def propose(self, seq: Sequence, max_len: int) -> tuple[int, ...]:
        return ()

    def free(self, request_id: str) -> None:
        return None


class DraftPolicy:
    """When a sequence may speculate and how long its draft may be (B4), around one Drafter."""

    def __init__(self, config: SpeculativeConfig, drafter: Drafter) -> None:
        self.config = config
        self.drafter = drafter
        self.num_drafted = 0  # draft tokens sent to verification
        self.num_accepted = 0  # of those, tokens the target accepted
        self.num_rounds = 0  # verify steps
        self._lengths: dict[str, int] = {}  # each request's current draft length (see `record`)

    @property
    def kind(self) -> str:
        return self.drafter.kind

    def draft(self, seq: Sequence, num_running: int, room: int) -> tuple[int, ...]:
        """A draft for decode row `seq`, at most `room` tokens; () when it should decode plainly."""
        if num_running > self.config.max_batch or room < max(self.config.draft_min, 1):
            return ()
        try:
            draft = self.drafter.propose(seq, min(room, self._lengths.get(seq.request_id, self.config.draft_max)))
        except Exception:  # noqa: BLE001 - a failing drafter costs speed, never the request
            log.exception("the %s drafter failed for request %s; it decodes without a draft", self.kind, seq.request_id)
            return ()
        return draft if len(draft) >= max(self.config.draft_min, 1) else ()

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """Count a verify round and adapt the request's draft length: doubled (up to --draft-max)
        after a fully accepted draft, else one past what was accepted, so a request whose drafts
        keep failing stops paying for long verify rows (the output does not depend on it)."""
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_rounds += 1
        length = self._lengths.get(request_id, self.config.draft_max)
        grown = min(2 * length, self.config.draft_max) if num_accepted == num_drafted else num_accepted + 1
        self._lengths[request_id] = max(grown, self.config.draft_min, 1)

    def free(self, request_id: str) -> None:
        self._lengths.pop(request_id, None)
        self.drafter.free(request_id)


def build_policy(config: SpeculativeConfig) -> DraftPolicy:
    """The policy for `config`'s draft kind (full-model drafters are built by the runtime, with weights)."""
    if config.draft_kind == "prompt-lookup":
        from mlxcel.engine.spec.prompt_lookup import PromptLookupDrafter

        return DraftPolicy(config, PromptLookupDrafter(config.ngram_size))
    return DraftPolicy(config, NoDrafter())
