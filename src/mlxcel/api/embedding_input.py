"""Request-body reading shared by the embedding and rerank adapters (OpenAI, llama-server,
Jina/Cohere/TEI): the `input` forms and typed field getters with 400-ready messages."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class InvalidRequestError(ValueError):
    """A request body the adapter refuses; the server answers 400 with the message."""


def parse_inputs(value: Any, field: str = "input", allow_mixed: bool = False) -> list[str | list[int]]:
    """`input` as a string, token ids, or a list of either; one entry per embedding.

    `allow_mixed` lets strings and token lists share one list (llama-server accepts it;
    OpenAI's schema does not).
    """
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(f"'{field}' must be a string, a list of strings or a list of token ids")
    if all(_is_token(item) for item in value):
        return [list(value)]
    items = [_parse_item(item, field, index) for index, item in enumerate(value)]
    if not allow_mixed and len({type(item) for item in items}) > 1:
        raise InvalidRequestError(f"'{field}' must not mix strings and token lists")
    return items


def _parse_item(item: Any, field: str, index: int) -> str | list[int]:
    if isinstance(item, str):
        return item
    if isinstance(item, list) and item and all(_is_token(token) for token in item):
        return list(item)
    raise InvalidRequestError(f"'{field}[{index}]' must be a string or a non-empty list of token ids")


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def get_bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequestError(f"'{key}' must be true or false")
    return value


def get_positive_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidRequestError(f"'{key}' must be a positive integer")
    return value


def get_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(f"'{key}' must be an integer")
    return value


def get_choice(body: Mapping[str, Any], key: str, choices: tuple[str, ...], default: str) -> str:
    value = body.get(key, default)
    if value is None:
        return default
    if value not in choices:
        raise InvalidRequestError(f"'{key}' must be one of {', '.join(choices)}, not {value!r}")
    return str(value)


def require_object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise InvalidRequestError("the request body must be a JSON object")
    return body
