"""Request headers every protocol reads the same way."""

from __future__ import annotations

from collections.abc import Mapping

from mlxcel.api.errors import invalid_request
from mlxcel.types import Priority

PRIORITY_HEADER = "x-priority"


def request_priority(headers: Mapping[str, str]) -> Priority:
    """X-Priority: high | normal | low (spec L); absent is normal, anything else is a 400."""
    try:
        return Priority.parse(headers.get(PRIORITY_HEADER))
    except ValueError as exc:
        raise invalid_request(f"X-Priority: {exc}") from None
