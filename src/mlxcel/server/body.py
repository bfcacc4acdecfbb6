"""Reading a JSON request body (D1): 415 for a missing or non-JSON Content-Type, 400 for bad JSON.

Runs after the Gate (auth, size) and before any availability check, dispatch or stream setup.
Hostile bodies are refused here with a 400 before any handler sees them: nesting deeper than
`MAX_JSON_DEPTH`, NaN/Infinity literals, integers outside 64 bits (they would overflow torch) or
longer than Python's digit limit, non-finite floats (1e99999), bodies that are not UTF-8, and
strings holding lone UTF-16 surrogates (no tokenizer can encode them).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException
from starlette.requests import Request

from mlxcel.api.errors import invalid_request


T = TypeVar("T")
MAX_FORM_FIELDS = 32


async def read_multipart(request: Request, *, expected: str, max_files: int,
                         read_file: Callable[[str, UploadFile], Awaitable[T]]) -> tuple[dict[str, list[str]], list[T]]:
    """A multipart/form-data body's text fields and its files, each read by `read_file(field, upload)`.

    `expected` says what the client should send ("the audio as ... a 'file' part") in the 415/400
    for another Content-Type; a malformed body is a 400. The form is closed whatever happens."""
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise invalid_request(f"send {expected} (Content-Type was {content_type or 'missing'!s})",
                              status=415 if content_type else 400)
    try:
        form = await request.form(max_files=max_files, max_fields=MAX_FORM_FIELDS)
    except MultiPartException as exc:
        raise invalid_request(f"malformed multipart body: {exc.message}") from None
    fields: dict[str, list[str]] = {}
    files: list[T] = []
    try:
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                files.append(await read_file(name, value))
            else:
                fields.setdefault(name, []).append(value)
    finally:
        await form.close()
    return fields, files


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
        # NOTE: json.loads(bytes) would guess UTF-16/32 and pass surrogate bytes; JSON is UTF-8 (RFC 8259).
        body = json.loads(raw.decode("utf-8").removeprefix("\ufeff"), parse_constant=_refuse_constant)
    except UnicodeDecodeError as exc:
        raise invalid_request(f"the request body is not UTF-8: {exc}") from None
    except json.JSONDecodeError as exc:
        raise invalid_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid_request(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except ValueError as exc:  # an integer literal over Python's 4,300-digit limit, or NaN/Infinity
        raise invalid_request(f"the request body is not valid JSON: {exc}"[:1024]) from None
    check_json_values(body, may_have_surrogates=_SURROGATE_ESCAPE.search(raw) is not None)
    return body


MAX_JSON_DEPTH = 128
MIN_JSON_INT, MAX_JSON_INT = -(2**63), 2**64 - 1  # what fits torch's int64 / uint64 seeds
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # raw surrogate bytes already fail the UTF-8 decode


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def check_json_values(body: Any, *, may_have_surrogates: bool = True) -> None:
    """Raise a 400 for nesting past MAX_JSON_DEPTH, out-of-range integers or lone surrogates."""
    stack: list[tuple[Any, int, str]] = [(body, 1, "body")]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise invalid_request(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_string(key, where, may_have_surrogates)
                stack.append((item, depth + 1, f"{where}.{key}"[:200]))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, f"{where}[{i}]"[:200]) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_string(value, where, may_have_surrogates)
        elif isinstance(value, int) and not isinstance(value, bool) and not MIN_JSON_INT <= value <= MAX_JSON_INT:
            raise invalid_request(f"{where}: the integer is out of range (64 bits at most)")
        elif isinstance(value, float) and not math.isfinite(value):  # 1e99999 parses as inf
            raise invalid_request(f"{where}: the number is out of range (not finite)")


def _check_string(value: str, where: str, may_have_surrogates: bool) -> None:
    if not may_have_surrogates:
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid_request(f"{where}: the string holds a lone UTF-16 surrogate (invalid Unicode)") from None
