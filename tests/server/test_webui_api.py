"""A5 control plane through the real server (ServerThread on 127.0.0.1 port 0): model-less start,
auth (session key, API key, wrong key), Origin checks, catalog, jobs, events, switch under load,
downloads from a fake hub on loopback, delete; A11 --api-prefix and C6 CORS on every route."""

from __future__ import annotations

import gc
import json
import shutil
import ssl
import subprocess
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxcel.loading.store import list_store
from tests.loading.fake_hub import FakeHub
from tests.server.webui_fixtures import (  # noqa: F401 - fixtures
    SESSION_KEY, WebUiServer, fake_hub, run_job, start_webui, ui_client, wait_job,
)

pytestmark = pytest.mark.slow
Client = tuple[httpx.Client, WebUiServer]


def chat(client: httpx.Client, content: str = "hi", **fields: Any) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
    return client.post("/v1/chat/completions", json=body | fields)


def test_a5_model_less_start_health_says_no_model_and_chat_is_503(ui_client: Client) -> None:
    client, _ = ui_client
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "no model loaded"
    reply = chat(client)
    assert reply.status_code == 503
    assert "no model loaded" in reply.json()["error"]["message"]
    assert client.get("/v1/models").json()["data"] == []  # listed empty, not an error
    models = client.get("/ui-api/v1/models").json()
    assert models["chat"] is None and models["embedding"] is None


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "wrong"},
                                     {"Cookie": f"key={SESSION_KEY}"}])
def test_a5_control_plane_needs_the_session_key_in_a_header(start_webui: Callable[..., WebUiServer],
                                                              headers: dict[str, str]) -> None:
    server = start_webui()
    reply = httpx.get(server.address + "/ui-api/v1/bootstrap", headers=headers)
    assert reply.status_code == 401 and reply.json()["error"]["type"] == "invalid_api_key"
    ok = httpx.get(server.address + "/ui-api/v1/bootstrap", headers={"X-Api-Key": SESSION_KEY})
    assert ok.status_code == 200 and ok.json()["settings"]["auth"] == "session-key"
    assert httpx.get(server.address + "/webui/").status_code == 200  # the shell itself is public


def test_a5_with_an_api_key_the_control_plane_takes_it_and_nothing_else(
        start_webui: Callable[..., WebUiServer]) -> None:
    server = start_webui(api_keys=("secret-1",))
    url = server.address + "/ui-api/v1/bootstrap"
    assert httpx.get(url, headers={"Authorization": f"Bearer {SESSION_KEY}"}).status_code == 401
    assert httpx.get(url).status_code == 401
    body = httpx.get(url, headers={"Authorization": "Bearer secret-1"}).json()
    assert body["settings"]["auth"] == "api-key" and body["features"]["settings_page"] is False


def test_a5_state_changing_calls_check_the_origin(ui_client: Client) -> None:
    client, server = ui_client
    evil = client.post("/ui-api/v1/models/load", json={"model": "tiny-a"}, headers={"Origin": "https://evil.example"})
    assert evil.status_code == 403 and evil.json()["error"]["type"] == "forbidden"
    assert client.get("/ui-api/v1/jobs").json()["data"] == []  # nothing was started
    # a read is fine from anywhere that holds the key; the server's own origin may change state
    assert client.get("/ui-api/v1/catalog", headers={"Origin": "https://evil.example"}).status_code == 200
    host = server.address.removeprefix("http://")
    same = client.post("/ui-api/v1/models/load", json={"model": "no-such/model"}, headers={"Origin": f"http://{host}"})
    assert same.status_code == 202


def test_a5_catalog_lists_the_store_and_packaged_models_with_their_facts(ui_client: Client) -> None:
    client, server = ui_client
    catalog = client.get("/ui-api/v1/catalog").json()
    by_name = {entry["name"]: entry for entry in catalog["data"]}
    tiny = by_name["tiny-a"]
    assert tiny["source"] == "store" and tiny["kind"] == "chat" and tiny["family"] == "llama"
    assert tiny["context"] == 256 and tiny["size_bytes"] > 10_000 and tiny["quantization"] == "float32"
    assert tiny["is_deletable"] and tiny["loaded_as"] is None
    default = by_name["SmolLM2-135M-Instruct"]
    assert default["source"] == "packaged" and default["quantization"] == "Q4_1" and not default["is_deletable"]
    assert default["family"] == "llama" and default["context"] == 8192


def test_a5_load_job_lifecycle_then_chat_then_unload(ui_client: Client) -> None:
    client, server = ui_client
    reply = client.post("/ui-api/v1/models/load", json={"model": str(server.models_dir / "tiny-a")})
    assert reply.status_code == 202 and reply.json()["job"]["state"] in ("queued", "running")
    job = wait_job(client, reply.json()["job"])
    assert job["state"] == "succeeded" and job["progress"] == 1.0 and job["result"]["model"] == "tiny-a"
    assert [j["id"] for j in client.get("/ui-api/v1/jobs").json()["data"]] == [job["id"]]
    assert client.post(f"/ui-api/v1/jobs/{job['id']}/cancel").status_code == 409  # already done
    assert client.get("/ui-api/v1/jobs/job-nope").status_code == 404
    assert client.get("/health").json()["status"] == "ok"
    assert chat(client).json()["choices"][0]["finish_reason"] in ("length", "stop")
    states = client.get("/ui-api/v1/models").json()
    assert states["chat"]["name"] == "tiny-a" and states["chat"]["model_type"] == "llama"
    catalog = {e["name"]: e for e in client.get("/ui-api/v1/catalog").json()["data"]}
    assert catalog["tiny-a"]["loaded_as"] == "chat"
    runtime = client.get("/ui-api/v1/runtime").json()
    assert runtime["model"] == "tiny-a" and len(runtime["slots"]) == 4 and runtime["counters"]["requests_completed"] >= 1
    assert 0.0 <= runtime["kv"]["usage"] <= 1.0 and runtime["prefix_cache"]["enabled"] is True
    second = run_job(client, "/models/load", {"model": "tiny-b"})
    assert second["state"] == "failed" and "already loaded" in second["error"]  # switch replaces a model
    unload = run_job(client, "/models/unload", {})
    assert unload["state"] == "succeeded" and unload["result"]["retired"] == "tiny-a"
    assert chat(client).status_code == 503


def test_a5_a_queued_job_can_be_cancelled_and_never_runs(ui_client: Client) -> None:
    client, server = ui_client
    with server.control.jobs.model_lock:  # another model action is running: the next one waits its turn
        reply = client.post("/ui-api/v1/models/load", json={"model": "tiny-a"})
        job = reply.json()["job"]
        assert job["state"] == "queued"
        cancel = client.post(f"/ui-api/v1/jobs/{job['id']}/cancel")
        assert cancel.status_code == 202
    job = wait_job(client, job)
    assert job["state"] == "cancelled" and server.state.served is None
    assert chat(client).status_code == 503


def test_a5_refused_actions_are_failed_jobs_or_400s(ui_client: Client) -> None:
    client, _ = ui_client
    failed = run_job(client, "/models/load", {"model": "acme/not-downloaded"})
    assert failed["state"] == "failed" and "not in the local store" in failed["error"]
    assert run_job(client, "/models/unload", {})["state"] == "failed"  # nothing loaded
    for path, body in (("/models/switch", {}), ("/models/load", {"model": 3}), ("/models/unload", {"mode": "x"}),
                       ("/models/load", {"role": "vision"}), ("/downloads", {"repo_id": "../etc"})):
        reply = client.post(f"/ui-api/v1{path}", json=body)
        assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error", (path, reply.text)
    bad = client.post("/ui-api/v1/models/load", content=b"{nope", headers={"Content-Type": "application/json"})
    assert bad.status_code == 400


def read_events(client: httpx.Client, until: Callable[[list[dict[str, Any]]], bool], since: int = 0,
                timeout: float = 120.0) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    with client.stream("GET", f"/ui-api/v1/events?since={since}", timeout=timeout) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append({"event": kind, "data": json.loads(line[6:])})
                if until(events):
                    return events
    raise AssertionError("the event stream ended")


def test_a5_events_stream_job_progress_model_states_and_counters(ui_client: Client) -> None:
    client, _ = ui_client
    job = run_job(client, "/models/load", {"model": "tiny-a"})

    def seen_all(events: list[dict[str, Any]]) -> bool:
        return sum(e["event"] == "stats" for e in events) >= 2

    events = read_events(client, seen_all)
    assert events[0]["event"] == "hello"
    job_states = [e["data"]["state"] for e in events if e["event"] == "job" and e["data"]["id"] == job["id"]]
    assert job_states[0] == "queued" and "running" in job_states and job_states[-1] == "succeeded"
    model_states = [e["data"]["state"] for e in events if e["event"] == "model"]
    assert model_states == ["loading", "loaded"]
    stats = [e["data"] for e in events if e["event"] == "stats"][-1]
    assert stats["model"] == "tiny-a" and "throughput" in stats and "queue_depth" in stats


def _stream_chat(address: str, results: list[Any], max_tokens: int) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "count"}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    try:
        with httpx.stream("POST", address + "/v1/chat/completions", json=body, timeout=120) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        results.append((response.status_code, chunks[-1]["choices"][0]["finish_reason"], len(chunks)))
    except Exception as exc:  # noqa: BLE001 - recorded and asserted below
        results.append(exc)


def test_a5_switch_under_load_drains_every_request_and_frees_the_old_model(ui_client: Client) -> None:
    client, server = ui_client
    run_job(client, "/models/load", {"model": "tiny-a"})
    old_thread = server.state.served.engine.core._thread  # type: ignore[union-attr]
    old_model = weakref.ref(server.state.served.loaded.model)  # type: ignore[union-attr]
    results: list[Any] = []
    threads = [threading.Thread(target=_stream_chat, args=(server.address, results, 120)) for _ in range(6)]
    for thread in threads:
        thread.start()
    reply = client.post("/ui-api/v1/models/switch", json={"model": "tiny-b", "mode": "drain"})
    late = [threading.Thread(target=_stream_chat, args=(server.address, results, 20)) for _ in range(4)]
    for thread in late:  # arriving while the switch runs: served by one model or the other, never lost
        thread.start()
    job = wait_job(client, reply.json()["job"])
    for thread in threads + late:
        thread.join(120)
    assert job["state"] == "succeeded", job
    assert job["result"]["previous"] == "tiny-a" and job["result"]["drained"] is True
    assert len(results) == 10 and all(r == (200, "length", r[2]) for r in results), results
    assert client.get("/ui-api/v1/models").json()["chat"]["name"] == "tiny-b"
    assert chat(client).status_code == 200
    assert not old_thread.is_alive()  # the old engine stopped ...
    gc.collect()
    assert old_model() is None  # ... and its weights were freed


def test_a5_switch_with_abort_ends_in_flight_requests_with_abort(ui_client: Client) -> None:
    client, server = ui_client
    run_job(client, "/models/load", {"model": "tiny-a"})
    results: list[Any] = []
    streams = [threading.Thread(target=_stream_chat, args=(server.address, results, 100_000)) for _ in range(2)]
    for thread in streams:
        thread.start()
    import time

    deadline = time.monotonic() + 30
    while server.state.served.engine.stats().active_sequences < 2 and time.monotonic() < deadline:  # type: ignore
        time.sleep(0.02)
    job = run_job(client, "/models/switch", {"model": "tiny-b", "mode": "abort"})
    for thread in streams:
        thread.join(60)
    assert job["state"] == "succeeded" and job["result"]["drained"] is False
    assert [r[1] for r in results] == ["abort", "abort"], results


def test_a5_download_from_the_hub_with_progress_then_load_then_delete(ui_client: Client, fake_hub: FakeHub) -> None:
    client, server = ui_client
    reply = client.post("/ui-api/v1/downloads", json={"repo_id": "acme/tiny-llama"})
    assert reply.status_code == 202
    job = wait_job(client, reply.json()["job"])
    assert job["state"] == "succeeded" and job["progress"] == 1.0, job
    events = read_events(client, lambda ev: any(e["event"] == "stats" for e in ev))
    progress = [e["data"]["progress"] for e in events if e["event"] == "job" and e["data"]["id"] == job["id"]]
    assert len({p for p in progress if 0 < p < 1}) >= 3 and progress[-1] == 1.0  # several steps, in order
    assert progress == sorted(progress)
    assert all(path.startswith(("/api/", "/acme/")) for path in fake_hub.paths())
    entry = next(e for e in client.get("/ui-api/v1/catalog").json()["data"] if e["id"] == "acme/tiny-llama")
    assert entry["size_bytes"] >= 4 << 20 and entry["family"] == "llama"
    assert run_job(client, "/models/load", {"model": "acme/tiny-llama"})["state"] == "succeeded"
    refused = client.post("/ui-api/v1/models/delete", json={"model": "acme/tiny-llama"})
    assert refused.status_code == 409 and "unload it first" in refused.json()["error"]["message"]
    run_job(client, "/models/unload", {"mode": "abort"})
    assert client.post("/ui-api/v1/models/delete", json={"model": "acme/tiny-llama"}).status_code == 200
    assert not (server.models_dir / "models--acme--tiny-llama").exists()
    assert "acme/tiny-llama" not in [e.id for e in list_store(server.models_dir)]
    packaged = client.post("/ui-api/v1/models/delete", json={"model": "all-minilm-l6-v2"})
    assert packaged.status_code == 409
    assert client.post("/ui-api/v1/models/delete", json={"model": "nope/nope"}).status_code == 404


def test_a5_download_of_an_unknown_repo_fails_with_one_line(ui_client: Client, fake_hub: FakeHub) -> None:
    client, _ = ui_client
    job = run_job(client, "/downloads", {"repo_id": "acme/missing"})
    assert job["state"] == "failed" and "acme/missing was not found on" in job["error"] and "\n" not in job["error"]


def test_a5_embedding_side_model_loads_and_unloads(ui_client: Client) -> None:
    client, _ = ui_client
    job = run_job(client, "/models/load", {"model": "all-minilm-l6-v2", "role": "embedding"})
    assert job["state"] == "succeeded", job
    reply = client.post("/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": "hello"})
    assert reply.status_code == 200 and len(reply.json()["data"][0]["embedding"]) == 384
    assert client.get("/ui-api/v1/models").json()["embedding"] == "all-minilm-l6-v2"
    assert run_job(client, "/models/unload", {"role": "embedding"})["state"] == "succeeded"
    assert client.post("/v1/embeddings", json={"input": "hello"}).status_code == 501


# ---- A11 and C6, for every route ----

def test_a11_api_prefix_mounts_every_route_under_it(start_webui: Callable[..., WebUiServer]) -> None:
    server = start_webui(api_prefix="/llm")
    base = server.address
    assert httpx.get(base + "/llm/health").json()["status"] == "no model loaded"
    assert httpx.get(base + "/health").status_code == 404
    assert httpx.get(base + "/llm/v1/models").json() == {"object": "list", "data": []}
    assert httpx.get(base + "/v1/models").status_code == 404
    assert "<html" in httpx.get(base + "/llm/webui/").text
    assert httpx.get(base + "/llm/webui").headers["location"] == "/llm/webui/"
    boot = httpx.get(base + "/llm/ui-api/v1/bootstrap", headers={"X-Api-Key": SESSION_KEY}).json()
    assert boot["settings"]["api_prefix"] == "/llm"


def test_c6_cors_policy_preflight_headers_and_refusals(start_webui: Callable[..., WebUiServer]) -> None:
    server = start_webui(cors_origins=("https://app.example",))
    base = server.address
    preflight = httpx.options(base + "/v1/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    allowed = httpx.get(base + "/health", headers={"Origin": "https://app.example"})
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    for method in ("GET", "OPTIONS", "POST"):
        denied = httpx.request(method, base + "/v1/models", headers={"Origin": "https://evil.example",
                                                                      "Access-Control-Request-Method": "GET"})
        assert denied.status_code == 403 and denied.json()["error"]["type"] == "forbidden"
    assert httpx.get(base + "/v1/models").status_code == 200  # no Origin: accepted


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is needed to make a test certificate")
def test_a5_tls_listener_serves_the_control_plane_over_https(start_webui: Callable[..., WebUiServer],
                                                             tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    server = start_webui(api_keys=("k-tls",), ssl_keyfile=key, ssl_certfile=cert)
    assert server.address.startswith("https://127.0.0.1:")
    boot = httpx.get(server.address + "/ui-api/v1/bootstrap", headers={"X-Api-Key": "k-tls"},
                     verify=ssl.create_default_context(cafile=str(cert)))
    assert boot.status_code == 200 and boot.json()["settings"]["tls"] is True
