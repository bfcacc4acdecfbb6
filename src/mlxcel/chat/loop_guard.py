"""Loop detection (spec P): end a generation whose tail repeats a short token pattern.

A pattern of `min_pattern_size`..`max_pattern_size` tokens repeated `min_count` times in a row
at the end of the output ends the request with FinishReason.LOOP (as vLLM's repetition
detection does). `max_pattern_size == 0` means off.

Three layers, each field of a later one overriding the earlier (per field):
  1. the model family's default: on for Gemma 4 (min 1, max 20, count 4), off elsewhere;
  2. the operator override MLXCEL_LOOP_DETECTION, for every request of this server;
  3. the request's own `max_pattern_size`, `min_pattern_size`, `min_count`
     (`ChatOptions.loop_overrides`; `max_pattern_size: 0` turns the guard off even on a Gemma 4 server).

MLXCEL_LOOP_DETECTION format: `off` (also 0/false/no/disabled), `on` (also 1/true/yes/enabled:
the standard 20/1/4), or comma-separated `key=value` pairs with keys `max_pattern_size`
(or `max`), `min_pattern_size` (or `min`), `min_count` (or `count`), e.g. `max=8,count=6`;
keys not given keep the standard values. Anything else refuses startup.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from mlxcel.types import FinishReason

FIELDS = ("max_pattern_size", "min_pattern_size", "min_count")
_ALIASES = {"max": "max_pattern_size", "min": "min_pattern_size", "count": "min_count"}
_OFF = frozenset({"off", "0", "false", "no", "disabled", "none"})
_ON = frozenset({"on", "1", "true", "yes", "enabled"})
LOOP_FAMILIES = ("gemma4",)  # model_type prefixes with the guard on by default


class LoopGuardError(ValueError):
    """Invalid loop-detection settings (a 400 for a request, a startup error for the variable)."""


@dataclass(frozen=True, slots=True)
class LoopPolicy:
    """The n-gram repeat guard's settings; `max_pattern_size == 0` = off."""

    max_pattern_size: int = 20
    min_pattern_size: int = 1
    min_count: int = 4

    @property
    def is_enabled(self) -> bool:
        return self.max_pattern_size > 0

    def validate(self, where: str) -> LoopPolicy:
        """Raise LoopGuardError (naming `where`) unless these settings make sense."""
        if self.max_pattern_size < 0:
            raise LoopGuardError(f"{where}: max_pattern_size must be 0 (off) or more, not {self.max_pattern_size}")
        if not self.is_enabled:
            return self
        if self.min_pattern_size < 1:
            raise LoopGuardError(f"{where}: min_pattern_size must be at least 1, not {self.min_pattern_size}")
        if self.min_pattern_size > self.max_pattern_size:
            raise LoopGuardError(f"{where}: min_pattern_size ({self.min_pattern_size}) must not exceed "
                                 f"max_pattern_size ({self.max_pattern_size})")
        if self.min_count < 2:
            raise LoopGuardError(f"{where}: min_count must be at least 2, not {self.min_count}")
        return self


STANDARD = LoopPolicy()
OFF = LoopPolicy(max_pattern_size=0)


def family_policy(model_type: str) -> LoopPolicy:
    """Layer 1: on for Gemma 4 (model_type gemma4, gemma4_text...), off for other families."""
    return STANDARD if model_type.lower().startswith(LOOP_FAMILIES) else OFF


def parse_operator_override(text: str | None) -> dict[str, int]:
    """Layer 2: MLXCEL_LOOP_DETECTION as per-field overrides ({} when unset)."""
    if text is None or not text.strip():
        return {}
    value = text.strip().lower()
    if value in _OFF:
        return {"max_pattern_size": 0}
    if value in _ON:
        return {f: getattr(STANDARD, f) for f in FIELDS}
    fields = {f: getattr(STANDARD, f) for f in FIELDS}
    for item in value.split(","):
        key, sep, number = item.partition("=")
        name = _ALIASES.get(key.strip(), key.strip())
        if not sep or name not in FIELDS or not number.strip().isdigit():
            raise LoopGuardError(f"MLXCEL_LOOP_DETECTION={text!r}: expected off, on, or key=value pairs "
                                 f"with keys max_pattern_size, min_pattern_size, min_count")
        fields[name] = int(number)
    replace(STANDARD, **fields).validate("MLXCEL_LOOP_DETECTION")
    return fields


def check_request_overrides(fields: Mapping[str, Any]) -> dict[str, int]:
    """Layer 3: the request's loop-guard fields that are present (None values dropped), each an
    integer; raises LoopGuardError naming the field."""
    found: dict[str, int] = {}
    for field in FIELDS:
        value = fields.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise LoopGuardError(f"{field} must be an integer, not {value!r}")
        found[field] = value
    return found


def resolve_loop_policy(
    family: LoopPolicy, operator: Mapping[str, int], fields: Mapping[str, int]
) -> LoopPolicy:
    """The policy for one request: family < operator < request (`fields`, checked by
    check_request_overrides), per field. Raises LoopGuardError (a 400) when they make no sense."""
    policy = replace(family, **operator)
    if not fields:
        return policy
    if not policy.is_enabled and "max_pattern_size" not in fields:
        # Any loop field opts in on a server where the guard is off; unset fields are standard.
        policy = STANDARD
    return replace(policy, **fields).validate("request")


class LoopGuard:
    """A TokenProcessor that ends the request with LOOP when the output tail repeats."""

    def __init__(self, policy: LoopPolicy) -> None:
        if not policy.is_enabled:
            raise ValueError("LoopGuard needs an enabled policy (max_pattern_size > 0)")
        self.policy = policy
        self._output: list[int] = []

    def process(self, logits: torch.Tensor, output_ids: Sequence[int]) -> None:
        return None  # the guard only watches; it never changes the distribution

    def accept(self, token_id: int) -> FinishReason | None:
        self._output.append(token_id)
        return FinishReason.LOOP if self.is_looping() else None

    def is_looping(self) -> bool:
        """Whether the output ends in some pattern repeated min_count times in a row."""
        out, p = self._output, self.policy
        for size in range(p.min_pattern_size, p.max_pattern_size + 1):
            span = size * p.min_count
            if span > len(out):
                break
            tail = out[-span:]
            if tail == tail[-size:] * p.min_count:
                return True
        return False


def make_loop_guard(policy: LoopPolicy) -> LoopGuard | None:
    """The processor for a request's policy; None when the guard is off."""
    return LoopGuard(policy) if policy.is_enabled else None
