"""Shared request-schema helpers: the strict pydantic base, body validation to 400 (D1), extra_body.

Every protocol's request models derive from `WireModel`: JSON types are checked strictly (a
string is not a number), unknown fields are ignored, and a failed validation becomes an
`invalid_request_error` whose message is pydantic's, one line per field, cut to 1 KiB.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from mlxcel.api.errors import ApiError, invalid_request

M = TypeVar("M", bound=BaseModel)
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # the range torch.Generator.manual_seed accepts
# The roles a chat message may have (OpenAI's, plus llama-server's legacy "function"); others are a 400.
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class WireModel(BaseModel):
    """Base of request bodies and their parts: strict JSON types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


def validation_message(exc: ValidationError) -> str:
    """`field.path: message` for each error, as one line."""
    parts = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(p) for p in error["loc"]) or "body"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


def validate_body(model: type[M], body: Any) -> M:
    """Validate a parsed JSON body into `model`; raises ApiError(400) with pydantic's message."""
    if not isinstance(body, Mapping):
        raise invalid_request(f"the request body must be a JSON object, not {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid_request(validation_message(exc)) from None
    except ValueError as exc:  # a field validator's own message
        raise invalid_request(str(exc)) from None


def flatten_extra_body(body: Any) -> Any:
    """Lift fields nested in `extra_body` to the root; a field already at the root wins (spec M).

    The OpenAI SDK flattens `extra_body` itself, but clients that send it literally (vLLM-style)
    nest it, so `cache_prompt`, `top_k` and friends are honoured in both forms. Anything that
    is not an object is returned as is.
    """
    if not isinstance(body, Mapping) or not isinstance(body.get("extra_body"), Mapping):
        return body  # validate_body reports a non-object body; a bad extra_body fails its type
    extra = body["extra_body"]
    merged = {**extra, **body}
    merged.pop("extra_body", None)
    return merged


def require(condition: bool, message: str) -> None:
    """Raise a 400 invalid_request_error unless `condition` holds."""
    if not condition:
        raise invalid_request(message)


__all__ = ["MAX_SEED", "MIN_SEED", "ApiError", "ChatRole", "WireModel", "flatten_extra_body", "require",
           "validate_body", "validation_message"]
