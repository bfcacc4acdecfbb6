"""E2: pin Claude Code's billing stamp so consecutive turns keep hitting the prefix cache.

Claude Code opens its system prompt with a line such as

    x-anthropic-billing-header: cc_version=2.1.39.c39; cc_entrypoint=cli; cch=56445;

whose `cch` value changes on every request and whose 4th `cc_version` part changes per session.
Rendered as is, every turn's prompt would differ a few tokens in, so no cached prefix could be
reused. Each value is replaced by as many `f` characters before rendering; only a top-level
system text that starts exactly with the stamp is touched, and only its first line.
"""

from __future__ import annotations

import re

BILLING_STAMP = "x-anthropic-billing-header"
_CC_VERSION_4TH = re.compile(r"(cc_version=(?:[^.;\s]*\.){3})([^.;\s]+)")
_CCH = re.compile(r"(cch=)([^;\s]+)")


def pin_billing_stamp(text: str) -> str:
    """`text` with the stamp's per-request values pinned; any other text unchanged."""
    if not text.startswith(BILLING_STAMP):
        return text
    line, newline, rest = text.partition("\n")
    line = _CC_VERSION_4TH.sub(_as_fs, line, count=1)
    line = _CCH.sub(_as_fs, line, count=1)
    return line + newline + rest


def _as_fs(match: re.Match[str]) -> str:
    return match.group(1) + "f" * len(match.group(2))
