"""Reading a JSON request body (D1): 415 for a missing or non-JSON Content-Type, 400 for bad JSON.

Runs after the Gate (auth, size) and before any availability check, dispatch or stream setup.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from mlxcel.api.errors import invalid_request


def is_json_content_type(value: str | None) -> bool:
    """application/json, with parameters (charset) or a +json suffix type."""
    if not value:
        return False
    media = value.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def read_json(request: Request) -> Any:
    """The parsed body; raises ApiError 415 / 400 with the parser's message cut to 1 KiB."""
    content_type = request.headers.get("content-type")
    if not is_json_content_type(content_type):
        got = f"got {content_type!r}" if content_type else "none was sent"
        raise invalid_request(f"Content-Type must be application/json ({got})", status=415)
    raw = await request.body()
    if not raw.strip():
        raise invalid_request("the request body is empty; a JSON object is required")
    try:
        return json.loads(raw)
    except UnicodeDecodeError as exc:
        raise invalid_request(f"the request body is not UTF-8: {exc}") from None
    except json.JSONDecodeError as exc:
        raise invalid_request(f"the request body is not valid JSON: {exc}") from None
