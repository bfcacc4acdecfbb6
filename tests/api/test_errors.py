"""Error envelopes per protocol and engine-error mapping (D1, C1)."""

from __future__ import annotations

from mlxcel.api.errors import (
    ApiError, error_body, from_engine_error, invalid_api_key, invalid_request, truncate_message,
)
from mlxcel.types import ContextOverflowError, EngineShutdownError, QueueFullError


def test_c1_exact_401_body() -> None:
    error = invalid_api_key()
    assert error.status == 401
    assert error_body(error) == {"error": {"message": "Invalid API key", "type": "invalid_api_key"}}


def test_d1_truncate_to_one_kib_on_a_character_boundary() -> None:
    assert truncate_message("abc") == "abc"
    cut = truncate_message("é" * 1000)  # 2000 bytes
    assert len(cut.encode()) == 1024 and cut == "é" * 512
    cut = truncate_message("a" + "€" * 600)  # 1 + 1800 bytes; 1024 falls inside a character
    assert len(cut.encode()) <= 1024 and cut.endswith("€")
    assert len(invalid_request("x" * 5000).message) == 1024


def test_openai_and_anthropic_envelopes() -> None:
    error = ApiError(400, "bad", code=400, extra={"n_ctx": 8})
    assert error_body(error) == {"error": {"message": "bad", "type": "invalid_request_error", "code": 400, "n_ctx": 8}}
    assert error_body(error, "anthropic") == {"type": "error", "error": {"type": "invalid_request_error",
                                                                         "message": "bad"}}
    assert error_body(ApiError(503, "busy"), "anthropic")["error"]["type"] == "overloaded_error"


def test_d1_every_413_uses_the_openai_envelope() -> None:
    assert error_body(ApiError(413, "too big"), "anthropic") == {"error": {"message": "too big",
                                                                           "type": "invalid_request_error"}}


def test_engine_errors_map_to_status() -> None:
    overflow = from_engine_error(ContextOverflowError(2000, 1024))
    assert (overflow.status, overflow.type) == (400, "exceed_context_size_error")
    assert overflow.extra == {"n_prompt_tokens": 2000, "n_ctx": 1024}
    full = from_engine_error(QueueFullError("full"))
    assert full.status == 503 and full.headers == {"Retry-After": "1"}
    assert from_engine_error(EngineShutdownError("stop")).status == 503
    assert from_engine_error(ValueError("empty prompt")).status == 400
