"""API key check (C1): Bearer token or X-Api-Key header, compared in constant time."""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Sequence
from pathlib import Path

PUBLIC_PATHS = frozenset({"/", "/health", "/v1/health"})  # C1, K1: never need a key


def read_api_key_file(path: Path) -> list[str]:
    """One key per non-empty line (surrounding whitespace ignored)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--api-key-file {path}: cannot read it ({exc.strerror})") from None
    keys = [line.strip() for line in text.splitlines() if line.strip()]
    if not keys:
        raise ValueError(f"--api-key-file {path}: the file holds no key")
    return keys


def split_keys(value: str | None) -> list[str]:
    """--api-key and LLAMA_API_KEY take one key or several separated by commas (as llama-server)."""
    return [k.strip() for k in (value or "").split(",") if k.strip()]


def presented_key(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The key a request carries: `Authorization: Bearer KEY`, else `X-Api-Key: KEY`."""
    api_key = None
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
        elif lowered == b"x-api-key":
            api_key = value.strip()
    return api_key


def is_valid_key(presented: bytes | None, keys: Sequence[str]) -> bool:
    """Constant time per configured key; every key is compared, so timing reveals no match position."""
    if presented is None:
        return False
    results = [hmac.compare_digest(presented, key.encode("utf-8")) for key in keys]
    return any(results)
