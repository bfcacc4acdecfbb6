"""Request memory admission (spec O) through the real server: a request whose KV estimate is over
MLXCEL_REQUEST_MEMORY_BUDGET gets 503 request_memory_budget_exceeded before any forward pass,
a streaming one before the SSE headers; the context check comes first (400); smaller requests run."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from mlxcel.config import EngineConfig
from mlxcel.serving.served_model import ServedModel
from mlxcel.server.lifecycle import ServerThread

from .conftest import chat_body, engine_like


@pytest.fixture(scope="module")
def small_budget(served: ServedModel, start_server: Callable[..., ServerThread]) -> Iterator[httpx.Client]:
    bytes_per_token = served.engine.core.memory_budget.bytes_per_token
    config = EngineConfig(max_num_seqs=2, ctx_size=2048, request_memory_budget_bytes=96 * bytes_per_token)
    model = engine_like(served, config)
    thread = start_server(model)
    with httpx.Client(base_url=thread.address, timeout=120) as http:
        yield http
    model.close(30)


def test_o_over_budget_is_503_and_smaller_requests_run(small_budget: httpx.Client) -> None:
    stats_before = small_budget.get("/slots").json()
    refused = small_budget.post("/v1/chat/completions", json=chat_body(max_tokens=200))
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["code"] == "request_memory_budget_exceeded" and error["type"] == "request_memory_budget_exceeded"
    assert error["estimated_bytes"] > error["budget_bytes"]
    assert small_budget.get("/health").status_code == 200
    ok = small_budget.post("/v1/chat/completions", json=chat_body(max_tokens=4))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    assert len(small_budget.get("/slots").json()) == len(stats_before)


def test_o_streaming_request_is_refused_before_sse_headers(small_budget: httpx.Client) -> None:
    with small_budget.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=500, stream=True)) as reply:
        assert reply.status_code == 503
        assert reply.headers["content-type"].startswith("application/json")
        body = reply.read()
    assert b"request_memory_budget_exceeded" in body and b"data:" not in body


def test_o_anthropic_route_gets_its_envelope(small_budget: httpx.Client) -> None:
    reply = small_budget.post("/v1/messages", json={"model": "claude-x", "max_tokens": 500, "stream": True,
                                                    "messages": [{"role": "user", "content": "Hi"}]})
    assert reply.status_code == 503 and reply.json()["type"] == "error"


def test_o_context_check_comes_first(small_budget: httpx.Client) -> None:
    reply = small_budget.post("/v1/completions", json={"model": "m", "prompt": "word " * 1500, "max_tokens": 4})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "exceed_context_size_error"
