"""Auth (C1), request-body errors (D1), socket timeout (A8), Unix socket (A4) and routing envelopes.

These servers have no model attached: every check here must happen before availability,
so a well-formed generation request gets 503 "Loading model" and a malformed one its 4xx.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread

KEY = "sk-test-key"
EXACT_401 = {"error": {"message": "Invalid API key", "type": "invalid_api_key"}}
GENERATION_ROUTES = ("/v1/chat/completions", "/chat/completions", "/v1/completions",
                     "/v1/chat/completions/input_tokens", "/chat/completions/input_tokens")
VALID = {"/v1/completions": {"model": "m", "prompt": "hi"}}
VALID_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def open_server(start_server: Callable[..., ServerThread]) -> ServerThread:
    return start_server(None, ServerConfig(port=0, max_body_bytes=4096, timeout_s=1.0))


@pytest.fixture(scope="module")
def keyed_server(start_server: Callable[..., ServerThread]) -> ServerThread:
    return start_server(None, ServerConfig(port=0, api_keys=(KEY, "second-key")))


@pytest.fixture()
def http(open_server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=open_server.address, timeout=30) as client:
        yield client


def valid_body(path: str) -> dict[str, object]:
    return VALID.get(path, VALID_CHAT)


# ---- C1 ----

@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                                     {"X-Api-Key": "nope"}, {"Authorization": "Bearer"}])
def test_c1_missing_or_wrong_key_gets_exact_401(keyed_server: ServerThread, headers: dict[str, str]) -> None:
    for path in ("/v1/models", "/v1/chat/completions", "/slots", "/metrics", "/tools"):
        response = httpx.request("POST" if "chat" in path else "GET", keyed_server.address + path, headers=headers)
        assert response.status_code == 401, path
        assert response.json() == EXACT_401


def test_c1_bearer_and_x_api_key_both_accepted(keyed_server: ServerThread) -> None:
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"X-Api-Key": KEY}, {"Authorization": "Bearer second-key"}):
        response = httpx.get(keyed_server.address + "/v1/models", headers=headers)
        assert response.status_code == 503  # past auth; no model attached in this server


def test_c1_health_routes_need_no_key(keyed_server: ServerThread) -> None:
    for path in ("/health", "/v1/health", "/"):
        response = httpx.get(keyed_server.address + path)
        assert response.status_code == 503  # K1: loading
        assert response.json()["status"] == "loading model"


def test_d1_auth_comes_before_body_errors(keyed_server: ServerThread) -> None:
    response = httpx.post(keyed_server.address + "/v1/chat/completions", content=b"{broken",
                          headers={"Content-Type": "text/plain"})
    assert response.status_code == 401 and response.json() == EXACT_401


# ---- D1 ----

@pytest.mark.parametrize("path", GENERATION_ROUTES)
def test_d1_broken_and_empty_json_get_400(http: httpx.Client, path: str) -> None:
    for raw in (b"{", b"", b"   ", b'{"model": "m",}', b"\xff\xfe"):
        response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert response.status_code == 400, raw
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize("path", GENERATION_ROUTES)
def test_d1_missing_and_wrong_typed_fields_get_400_never_422(http: httpx.Client, path: str) -> None:
    body = valid_body(path)
    # "model" may be left out (llama-server and vLLM accept that); the prompt may not.
    cases = [{k: v for k, v in body.items() if k not in ("messages", "prompt")}, {**body, "model": 5}, [1, 2], "text",
             {**body, "max_tokens": "5"}, {**body, "stream": "yes"}, {**body, "n": 0}]
    for case in cases:
        response = http.post(path, json=case)
        assert response.status_code == 400, case
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_d1_parser_message_names_the_field(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": 1}]})
    message = response.json()["error"]["message"]
    assert "messages.0.role" in message


def test_d1_message_cut_to_one_kib(http: httpx.Client) -> None:
    bad = {"model": "m", "messages": [{"role": i} for i in range(150)]}  # 150 errors: a long message
    response = http.post("/v1/chat/completions", json=bad)
    assert response.status_code == 400
    assert len(response.json()["error"]["message"].encode()) == 1024


@pytest.mark.parametrize("path", GENERATION_ROUTES)
def test_d1_content_type_missing_or_not_json_gets_415(http: httpx.Client, path: str) -> None:
    raw = json.dumps(valid_body(path)).encode()
    for headers in ({}, {"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}):
        response = http.post(path, content=raw, headers=headers)
        assert response.status_code == 415, headers
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_d1_json_content_type_with_charset_accepted(http: httpx.Client) -> None:
    raw = json.dumps(VALID_CHAT).encode()
    response = http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json; charset=utf-8"})
    assert response.status_code == 503  # parsed fine; the model is not loaded


def test_d1_body_over_limit_gets_413_by_length_and_by_stream(http: httpx.Client) -> None:
    big = json.dumps({**VALID_CHAT, "pad": "x" * 5000}).encode()
    response = http.post("/v1/chat/completions", content=big, headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "invalid_request_error"

    def chunks() -> Iterator[bytes]:  # chunked transfer: no Content-Length to check up front
        for start in range(0, len(big), 1000):
            yield big[start:start + 1000]
    response = http.post("/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413


def test_d1_valid_body_reaches_availability_check(http: httpx.Client) -> None:
    for path in GENERATION_ROUTES:
        response = http.post(path, json=valid_body(path))
        assert response.status_code == 503, path
        assert response.json()["error"] == {"message": "Loading model", "type": "unavailable_error", "code": 503}


def test_a8_slow_body_times_out(open_server: ServerThread) -> None:
    host, port = open_server.address.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\"")
        started = time.monotonic()
        reply = sock.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 408") and time.monotonic() - started < 5


def test_a8_a_client_that_stops_reading_times_out_the_write() -> None:
    """A8 and issue 25: a write the socket takes at once runs without a deadline of its own; one that waits (the
    client reads nothing while the response streams) ends in TimeoutError after --timeout, so no slot stays
    pinned. A real uvicorn server on port 0 behind the Gate, a raw socket that never reads."""
    import asyncio
    import threading

    import uvicorn

    from mlxcel.server.gate import Gate

    outcome: list[str] = []
    chunk = b"x" * 65536

    async def app(scope, receive, send) -> None:  # noqa: ANN001 - a bare ASGI app
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        sent = 0
        try:
            for _ in range(2048):  # 128 MiB: far past what the socket buffers hold
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                sent += len(chunk)
            outcome.append("finished")
        except TimeoutError:
            outcome.append(f"timed out after {sent} bytes")
            raise

    gate = Gate(app, api_keys=(), public_paths=(), max_body_bytes=1024, timeout_s=0.5)
    server = uvicorn.Server(uvicorn.Config(gate, host="127.0.0.1", port=0, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            while not outcome and time.monotonic() < deadline:
                time.sleep(0.05)  # reads nothing
    finally:
        server.should_exit = True
        thread.join(10)
    assert len(outcome) == 1 and outcome[0].startswith("timed out after"), outcome
    assert 0 < int(outcome[0].split()[3]) < 2048 * len(chunk)  # many writes went through bare first


# ---- routing envelopes, F11 ----

def test_unknown_route_and_method_use_openai_envelope(http: httpx.Client) -> None:
    response = http.get("/v1/nothing-here")
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    response = http.get("/v1/chat/completions")
    assert response.status_code == 405 and "error" in response.json()


@pytest.mark.parametrize("path", ["/tools", "/cors-proxy"])
def test_f11_disabled_features_get_403(http: httpx.Client, path: str) -> None:
    for method in ("GET", "POST"):
        response = http.request(method, path)
        assert response.status_code == 403
        assert response.json()["error"]["type"] == "feature_disabled"


def test_k1_health_fields_while_loading(http: httpx.Client) -> None:
    response = http.get("/health")
    assert response.status_code == 503
    assert set(response.json()) == {"status", "model", "batch", "observability", "context_size", "tool_call_parser"}


# ---- A4 ----

def test_a4_unix_socket(start_server: Callable[..., ServerThread], tmp_path: Path) -> None:
    path = tmp_path / "mlxcel.sock"
    server = start_server(None, ServerConfig(host=str(path)))
    assert server.address == f"unix:{path}" and path.is_socket()
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://mlxcel") as client:
        assert client.get("/health").json()["status"] == "loading model"
    server.stop()
    assert not path.exists()
