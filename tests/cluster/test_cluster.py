"""Spec X end to end: `mlxcel cluster` on a local Ray cluster, 2 replicas of SmolLM2, through the real entry point.

One cluster for the module (Ray is heavy on 2 cores). Order matters: the affinity test runs
on fresh prefix trees first, the replica kill runs last.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.server import test_anthropic_routes as anthropic_routes
from tests.server import test_llama_server_routes as llama_routes
from tests.server import test_openai_routes as openai_routes

from .conftest import API_KEY, Cluster, listening_addresses, session_pids, start_cluster

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PIRATE = "You are a pirate captain. Answer every question in pirate speech, briefly and cheerfully. " * 6
LAWYER = "You are a careful contract lawyer. Answer formally, cite no cases, and keep it short. " * 6


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from start_cluster()


@pytest.fixture()
def client(cluster: Cluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.address, headers=AUTH, timeout=120) as http:
        yield http


@pytest.fixture()
def sdk(cluster: Cluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=cluster.address + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as client:
        yield client


def _chat(client: httpx.Client, system: str, turn: int) -> httpx.Response:
    body = {"model": "m", "temperature": 0, "max_tokens": 2,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Question {turn}?"}]}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response


def test_x_conversations_with_long_prefixes_stay_on_one_replica_with_cache_hits(client: httpx.Client) -> None:
    placed: dict[str, set[str]] = {PIRATE: set(), LAWYER: set()}
    cached: dict[str, list[int]] = {PIRATE: [], LAWYER: []}
    for turn in range(3):
        for system in (PIRATE, LAWYER):
            response = _chat(client, system, turn)
            placed[system].add(response.headers["x-mlxcel-replica"])
            cached[system].append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert all(len(replicas) == 1 for replicas in placed.values()), placed
    assert placed[PIRATE] != placed[LAWYER]  # fresh trees: the second prefix goes to the idle, emptier replica
    for counts in cached.values():
        assert counts[0] == 0 and all(c >= 96 for c in counts[1:]), cached  # the system prompt's blocks hit
    metrics = client.get("/metrics").text
    assert 'mlxcel_cluster_routed_total{replica="' in metrics and 'reason="prefix"' in metrics


def test_x_sticky_conversation_id_keeps_short_prompts_together(client: httpx.Client) -> None:
    replicas = set()
    for turn in range(3):
        response = client.post("/v1/chat/completions", headers={"X-Conversation-Id": "conv-7"},
                               json={"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": f"{turn}"}]})
        replicas.add(response.headers["x-mlxcel-replica"])
    assert len(replicas) == 1


def test_x_aggregated_health_models_slots_metrics(cluster: Cluster, client: httpx.Client) -> None:
    health = httpx.get(cluster.address + "/health")  # public, like serve's
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "ok" and len(body["replicas"]) == 2 and body["batch"]["max_batch_size"] == 4
    assert body["context_size"] == 1024 and body["model"] == "SmolLM2-135M-Instruct"
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["SmolLM2-135M-Instruct"]
    slots = client.get("/slots").json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3] and len({s["replica"] for s in slots}) == 2
    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    samples = [line for line in metrics.text.splitlines() if line.startswith("mlxcel_requests_total{")]
    assert len(samples) == 2 and all('replica="' in line for line in samples)
    assert metrics.text.count("# TYPE mlxcel_requests_total counter") == 1
    assert "mlxcel_cluster_replicas 2" in metrics.text


def test_f9_settings_patch_reaches_every_replica(cluster: Cluster, client: httpx.Client) -> None:
    reply = client.patch("/v1/settings", json={"settings": {"reasoning_budget": 9}})
    assert reply.status_code == 200 and reply.json()["applied"] == {"reasoning_budget": 9}
    seen = {client.get("/v1/settings", headers={"X-Conversation-Id": f"c{i}"}).json()["settings"]["reasoning_budget"]
            for i in range(8)}  # sticky keys spread the reads over the replicas
    assert seen == {9}
    assert client.patch("/v1/settings", json={"settings": {}, "replace": True}).status_code == 200


def test_x_local_ray_cluster_listens_on_loopback_only(cluster: Cluster) -> None:
    loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::1
    addresses = listening_addresses(session_pids(cluster.process.pid))
    assert addresses and addresses <= loopback, addresses  # the entry point, Ray's GCS, raylet, workers


def test_x_api_key_at_the_entry_point(cluster: Cluster) -> None:
    for path in ("/v1/chat/completions", "/v1/messages", "/slots"):  # serve's Gate, so serve's one envelope
        response = httpx.post(cluster.address + path, json={"model": "m"})
        assert response.status_code == 401 and response.json()["error"]["type"] == "invalid_api_key"
    too_big = httpx.post(cluster.address + "/v1/chat/completions", headers={**AUTH, "Content-Type": "application/json"},
                         content=b" " * (33 << 20))
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == 413


# ---- the serve tests, run against the cluster ----

def test_x_openai_family_answers_as_serve_does(sdk: openai.OpenAI, client: httpx.Client) -> None:
    openai_routes.test_f1_chat_non_streaming(sdk)
    openai_routes.test_f1_chat_streaming_equals_non_streaming_with_usage_chunk(sdk)
    openai_routes.test_f1_models(sdk, client)
    openai_routes.test_bad_requests_get_400(client)
    openai_routes.test_context_overflow_gets_400(client)
    unknown = client.get("/v1/nothing-here")
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"


def test_x_anthropic_family_answers_as_serve_does(cluster: Cluster, client: httpx.Client) -> None:
    anthropic_routes.test_e1_stream_event_sequence(client)
    bad = client.post("/v1/messages", content=b"{bad", headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    with anthropic.Anthropic(base_url=cluster.address, api_key=API_KEY, max_retries=0) as claude:
        message = claude.messages.create(model=anthropic_routes.MODEL, max_tokens=4, messages=anthropic_routes.HI,
                                         extra_body={"temperature": 0})
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 4


def test_x_llama_server_family_answers_as_serve_does(client: httpx.Client) -> None:
    llama_routes.test_f4_completion_native_shape(client)
    llama_routes.test_f4_stream_events(client)
    llama_routes.test_f4_tokenize_with_pieces_round_trips_through_detokenize(client)


# ---- failure: last, it takes a replica down ----

def _stream(cluster: Cluster, content: str, out: dict[str, Any], started: threading.Event) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 300, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", cluster.address + "/v1/chat/completions", json=body, headers=AUTH, timeout=120) as reply:
        out["replica"] = reply.headers["x-mlxcel-replica"]
        out["lines"] = lines = []
        for line in reply.iter_lines():
            lines.append(line)
            if sum(1 for x in lines if x.startswith("data: {")) == 3:
                started.set()


def test_x_killing_a_replica_loses_only_its_requests_and_the_cluster_recovers(cluster: Cluster,
                                                                             client: httpx.Client) -> None:
    results: list[dict[str, Any]] = [{}, {}]
    events = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=_stream, args=(cluster, text, out, ev), daemon=True)
               for text, out, ev in zip(("Tell me a story.", "Count to a thousand."), results, events)]
    for thread, event in zip(threads, events):  # one at a time, so the router puts them on both replicas
        thread.start()
        assert event.wait(120)
    assert results[0]["replica"] != results[1]["replica"]
    victim = results[0]["replica"]
    os.kill(cluster.replica_pids()[victim], signal.SIGKILL)
    for thread in threads:
        thread.join(120)
    lost, survived = results[0]["lines"], results[1]["lines"]
    error = json.loads(next(line for line in lost if line.startswith('data: {"error"'))[6:])["error"]
    assert error["code"] == 503 and error["type"] == "unavailable_error"
    assert "data: [DONE]" not in lost
    assert survived[-2] == "data: [DONE]"  # the other replica's stream finished untouched
    final = json.loads([line for line in survived if line.startswith("data: {")][-1][6:])
    assert final["choices"][0]["finish_reason"] == "length"
    after = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "Hi"}]})
    assert after.status_code == 200 and after.headers["x-mlxcel-replica"] != victim  # new work goes elsewhere
    end = time.monotonic() + 180
    while time.monotonic() < end:  # Ray restarts the replica: two healthy replicas again
        health = httpx.get(cluster.address + "/health").json()
        if len(health["replicas"]) == 2 and all(r["status"] == "ok" for r in health["replicas"]):
            break
        time.sleep(2)
    else:
        raise AssertionError(f"the cluster did not recover: {health}")
    assert victim not in {r["replica"] for r in health["replicas"]}
