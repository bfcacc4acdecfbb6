"""API errors and their wire envelopes: one envelope per protocol (D1).

Adapters raise `ApiError`; the server renders it with the envelope of the route's protocol:
OpenAI `{"error": {...}}` (also used for every 413, spec D1) or Anthropic
`{"type": "error", "error": {...}}`. Engine exceptions are mapped here once, so every
protocol answers a full queue or an oversized prompt the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from mlxcel.types import ContextOverflowError, EngineError, EngineShutdownError, QueueFullError, RequestMemoryError

Protocol = Literal["openai", "anthropic"]
MAX_MESSAGE_BYTES = 1024  # D1: parser messages are cut to 1 KiB
QUEUE_FULL_RETRY_AFTER_S = 1

INVALID_REQUEST = "invalid_request_error"
REQUEST_MEMORY_BUDGET_EXCEEDED = "request_memory_budget_exceeded"


class ApiError(Exception):
    """An error reply: HTTP status, message, error type, and optional extra error fields."""

    def __init__(self, status: int, message: str, type: str = INVALID_REQUEST, *,  # noqa: A002 - wire name
                 code: int | str | None = None, headers: Mapping[str, str] | None = None,
                 extra: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})


def truncate_message(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """Cut to at most `limit` UTF-8 bytes without splitting a character."""
    data = message.encode("utf-8")
    return message if len(data) <= limit else data[:limit].decode("utf-8", errors="ignore")


def invalid_request(message: str, status: int = 400) -> ApiError:
    """A bad request body or field (D1); the message is cut to 1 KiB."""
    return ApiError(status, truncate_message(message), INVALID_REQUEST, code=status)


def invalid_api_key() -> ApiError:
    """C1: exactly {"error":{"message":"Invalid API key","type":"invalid_api_key"}}."""
    return ApiError(401, "Invalid API key", "invalid_api_key")


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body exceeds the {limit}-byte limit (--max-body-size)", INVALID_REQUEST,
                    code=413)


def unavailable(message: str, retry_after_s: int | None = None) -> ApiError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return ApiError(503, message, "unavailable_error", code=503, headers=headers)


def from_engine_error(exc: EngineError | ValueError) -> ApiError:
    """The reply for an exception `EngineClient.submit` raised."""
    if isinstance(exc, ContextOverflowError):
        return ApiError(400, str(exc), "exceed_context_size_error", code=400,
                        extra={"n_prompt_tokens": exc.num_prompt_tokens, "n_ctx": exc.context_size})
    if isinstance(exc, RequestMemoryError):  # spec O: before any forward pass (and before SSE headers)
        return ApiError(503, str(exc), REQUEST_MEMORY_BUDGET_EXCEEDED, code=REQUEST_MEMORY_BUDGET_EXCEEDED,
                        extra={"estimated_bytes": exc.estimated_bytes, "budget_bytes": exc.budget_bytes})
    if isinstance(exc, QueueFullError):
        return unavailable(f"{exc}; retry later", QUEUE_FULL_RETRY_AFTER_S)
    if isinstance(exc, EngineShutdownError):
        return unavailable(str(exc))
    if isinstance(exc, ValueError):
        return invalid_request(str(exc))
    return ApiError(500, str(exc) or type(exc).__name__, "server_error", code=500)


def openai_error_body(error: ApiError) -> dict[str, Any]:
    body: dict[str, Any] = {"message": error.message, "type": error.type}
    if error.code is not None:
        body["code"] = error.code
    body.update(error.extra)
    return {"error": body}


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large",
                    415: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error",
                    504: "timeout_error", 529: "overloaded_error"}


def anthropic_error_body(error: ApiError) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


ENVELOPES: dict[Protocol, Callable[[ApiError], dict[str, Any]]] = {
    "openai": openai_error_body,
    "anthropic": anthropic_error_body,
}


def error_body(error: ApiError, protocol: Protocol = "openai") -> dict[str, Any]:
    """The JSON body of `error` in `protocol`'s envelope; every 413 uses OpenAI's (D1)."""
    return ENVELOPES["openai" if error.status == 413 else protocol](error)
