"""Operations endpoints and request lifecycle on the real model: K1-K3, F7, F12, A9, queue full, disconnect."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from mlxcel.config import EngineConfig
from mlxcel.serving.served_model import ServedModel
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread

from .conftest import chat_body, engine_like, wait_until

pytestmark = pytest.mark.slow
LONG = {"max_tokens": 400, "ignore_eos": True}  # far longer than any test waits for


@pytest.fixture(scope="module")
def single(served: ServedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedModel]:
    """One slot, one waiting place, slot files on: for 503 paths and slot actions."""
    save_dir = tmp_path_factory.mktemp("slots")
    model = engine_like(served, EngineConfig(max_num_seqs=1, max_queue_depth=1, ctx_size=512,
                                             slot_save_path=str(save_dir)))
    yield model
    model.close(30)


@pytest.fixture(scope="module")
def single_server(single: ServedModel, start_server: Callable[..., ServerThread]) -> ServerThread:
    return start_server(single, ServerConfig(port=0))


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def first_content_line(lines: Iterator[str]) -> str:
    for line in lines:
        if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
            return line
    raise AssertionError("the stream ended before any content")


def is_idle(served: ServedModel) -> bool:
    stats = served.engine.stats()
    return stats.active_sequences == 0 and stats.queue_depth == 0 and stats.prefix_cache.num_blocks_used == 0


def next_started(model: ServedModel) -> bool:
    stats = model.engine.stats()
    return stats.queue_depth == 1 and stats.slots[0].is_processing


# ---- K1, K3, props ----

def test_k1_health_ok(client: httpx.Client, served: ServedModel) -> None:
    body = client.get("/health").json()
    assert body["status"] == "ok" and body["model"] == "SmolLM2-135M-Instruct"
    assert body["batch"] == {"active_sequences": 0, "queue_depth": 0, "max_batch_size": 4}
    assert body["context_size"] == 1024  # per slot: 4096 / 4
    assert set(body["observability"]) == {"sequences_started", "sequences_completed", "sequences_aborted"}
    assert client.get("/v1/health").json()["status"] == client.get("/").json()["status"] == "ok"


def test_k3_slots(client: httpx.Client) -> None:
    slots = client.get("/slots").json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    assert all(s["n_ctx"] == s["context_size"] == 1024 and not s["is_processing"] for s in slots)


def test_f12_props_on_and_off(client: httpx.Client, single_server: ServerThread) -> None:
    props = client.get("/props").json()
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 1024
    assert "im_start" in props["chat_template"]
    assert props["model_implementation"] == "native"  # issue 40: SmolLM2 runs our llama module, not transformers'
    off = httpx.get(single_server.address + "/props")
    assert off.status_code == 501 and off.json()["error"]["type"] == "not_supported_error"
    assert httpx.get(single_server.address + "/metrics").status_code == 501


def test_issue47_props_shows_where_the_disk_prefix_cache_lives_and_how_big_it_may_grow(
        client: httpx.Client, served: ServedModel, start_server: Callable[..., ServerThread], tmp_path: Path) -> None:
    off = client.get("/props").json()["prefix_cache_disk"]  # the session's engine has no disk tier
    assert off == {"enabled": False, "directory": None, "capacity_bytes": 0, "size_bytes": 0, "files": 0}
    folder = tmp_path / "prefix-cache"
    config = EngineConfig(max_num_seqs=1, ctx_size=512, prefix_cache_dir=str(folder), prefix_cache_disk_bytes=2**30)
    model = engine_like(served, config, cache_identity="issue47")
    try:
        server = start_server(model)
        disk = httpx.get(server.address + "/props").json()["prefix_cache_disk"]
        assert disk == {"enabled": True, "directory": str(folder), "capacity_bytes": 2**30, "size_bytes": 0,
                        "files": 0, "writable": True}
        stats = httpx.get(server.address + "/v1/cache/stats").json()["disk"]
        assert (stats["directory"], stats["capacity_bytes"]) == (disk["directory"], disk["capacity_bytes"])
    finally:
        model.close(30)


def test_f12_no_slots_flag(start_server: Callable[..., ServerThread], served: ServedModel) -> None:
    server = start_server(served, ServerConfig(port=0, endpoint_slots=False))
    assert httpx.get(server.address + "/slots").status_code == 501
    server.stop()


# ---- K2 ----

def test_k2_metrics_counting_rules(client: httpx.Client, server: ServerThread, served: ServedModel) -> None:
    before = client.get("/metrics").text
    sdk = openai.OpenAI(base_url=server.address + "/v1", api_key="x", max_retries=0)
    plain = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                        temperature=0)
    streamed = list(sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=4, temperature=0, stream=True))  # no usage asked for
    assert streamed[-1].choices[0].finish_reason == "length"
    with client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True, **LONG)) as cancelled:
        first_content_line(cancelled.iter_lines())
    wait_until(lambda: is_idle(served), what="the cancelled stream to be aborted")
    list(sdk.completions.create(model="m", prompt="Hi", max_tokens=2, temperature=0, stream=True))  # not counted
    sdk.completions.create(model="m", prompt="Hi", max_tokens=2, temperature=0)  # counted
    after = client.get("/metrics").text
    assert metric(after, "mlxcel_requests_total") - metric(before, "mlxcel_requests_total") == 3
    assert metric(after, "mlxcel_completion_tokens_total") - metric(before, "mlxcel_completion_tokens_total") == \
        plain.usage.completion_tokens + 4 + 2
    for name in ("mlxcel_batch_occupancy", "mlxcel_queue_depth", "mlxcel_tokens_generated_total",
                 "mlxcel_sequences_completed_total", "mlxcel_prefix_cache_hits_total",
                 "mlxcel_time_to_first_token_seconds_count", "mlxcel_inter_token_latency_seconds_count"):
        metric(after, name)


# ---- disconnect, A9 ----

def test_disconnect_aborts_and_frees_the_slot(client: httpx.Client, served: ServedModel) -> None:
    started = time.monotonic()
    with client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True, **LONG)) as response:
        lines = response.iter_lines()  # kept until the with-block closes the connection
        first_content_line(lines)
        assert any(s["is_processing"] for s in client.get("/slots").json())
    wait_until(lambda: is_idle(served), timeout=10, what="the slot to be freed")
    assert not any(s["is_processing"] for s in client.get("/slots").json())
    assert time.monotonic() - started < 15  # 400 tokens would take far longer: it was aborted
    # a non-streaming request whose client gives up is aborted too
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/chat/completions", json=chat_body(**LONG), timeout=1.5)
    wait_until(lambda: is_idle(served), timeout=10, what="the non-streaming request to be aborted")


def test_a9_keepalive_comment_while_silent(start_server: Callable[..., ServerThread], served: ServedModel) -> None:
    server = start_server(served, ServerConfig(port=0, sse_keepalive_s=0.01))
    with httpx.stream("POST", server.address + "/v1/chat/completions", json=chat_body(stream=True, max_tokens=4),
                      timeout=60) as response:
        lines = list(response.iter_lines())
    assert ": keepalive" in lines
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "length" and lines[-2] == "data: [DONE]"
    sdk = openai.OpenAI(base_url=server.address + "/v1", api_key="x", max_retries=0)
    chunks = list(sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks).startswith("Hello")
    server.stop()


# ---- 503 paths (one slot, one waiting place) ----

def test_queue_full_503_with_retry_after_and_health_503(single_server: ServerThread, single: ServedModel) -> None:
    with httpx.Client(base_url=single_server.address, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=chat_body(stream=True, **LONG)) as running:
            running_lines = running.iter_lines()  # kept: a dropped iterator closes its connection
            first_content_line(running_lines)
            health = http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "no slot available"
            with http.stream("POST", "/v1/chat/completions", json=chat_body(stream=True, max_tokens=2)) as waiting:
                wait_until(lambda: single.engine.stats().queue_depth == 1, what="the second request to wait")
                full = http.post("/v1/chat/completions", json=chat_body(max_tokens=1))
                assert full.status_code == 503 and full.headers["Retry-After"] == "1"
                assert full.json()["error"]["type"] == "unavailable_error"
                assert waiting.status_code == 200
                assert single.engine.stats().slots[0].is_processing  # the first request still runs
    wait_until(lambda: is_idle(single), what="both requests to end")


def test_l_x_priority_orders_the_waiting_queue(served: ServedModel, start_server: Callable[..., ServerThread]) -> None:
    model = engine_like(served, EngineConfig(max_num_seqs=1, max_queue_depth=4, ctx_size=512))
    server = start_server(model, ServerConfig(port=0))
    try:
        with httpx.Client(base_url=server.address, timeout=60) as http:
            with http.stream("POST", "/v1/chat/completions", json=chat_body(stream=True, **LONG)) as running:
                running_lines = running.iter_lines()  # kept: a dropped iterator closes its connection
                first_content_line(running_lines)
                ids: dict[str, str] = {}
                kept = []
                with http.stream("POST", "/v1/chat/completions", json=chat_body(stream=True, **LONG),
                                 headers={"X-Priority": "low"}) as low, \
                     http.stream("POST", "/v1/chat/completions", json=chat_body(stream=True, **LONG),
                                 headers={"X-Priority": "high"}) as high:
                    for name, response in (("low", low), ("high", high)):
                        kept.append(response.iter_lines())
                        ids[name] = json.loads(next(kept[-1])[6:])["id"]  # the role chunk
                    wait_until(lambda: model.engine.stats().queue_depth == 2, what="two waiting requests")
                    running.close()  # the slot frees: the high-priority request, sent second, goes first
                    wait_until(lambda: next_started(model), what="the next request to start")
                    assert model.engine.stats().slots[0].request_id.startswith(ids["high"])
        wait_until(lambda: is_idle(model), what="all requests to end")
    finally:
        server.stop()
        model.close(10)


# ---- F12 slot actions, F7 cache ----

def test_f12_slot_save_erase_restore(single_server: ServerThread, client: httpx.Client) -> None:
    with httpx.Client(base_url=single_server.address, timeout=60) as http:
        body = chat_body("Write one word about rivers and lakes and the open sea.", max_tokens=1)
        http.post("/v1/chat/completions", json=body)
        saved = http.post("/slots/0?action=save", json={"filename": "s0.bin"}).json()
        assert saved["id_slot"] == 0 and saved["n_saved"] >= 16 and saved["n_written"] > 0
        assert http.post("/slots/0?action=erase").json()["n_erased"] == saved["n_saved"]
        restored = http.post("/slots/0?action=restore", json={"filename": "s0.bin"}).json()
        assert restored["n_restored"] == saved["n_saved"]
        hit = http.post("/v1/chat/completions", json=body).json()
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == saved["n_saved"]
        for path, payload in (("/slots/0?action=bogus", {}), ("/slots/0?action=save", {"filename": "../x"}),
                              ("/slots/9?action=erase", None), ("/slots/x?action=erase", None),
                              ("/slots/0?action=restore", {"filename": "missing.bin"})):
            response = http.post(path, json=payload)
            assert response.status_code == 400, path
    assert client.post("/slots/0?action=save", json={"filename": "a"}).status_code == 501  # no --slot-save-path


def test_f7_cache_stats_and_reset(client: httpx.Client, served: ServedModel,
                                  start_server: Callable[..., ServerThread]) -> None:
    client.post("/v1/chat/completions", json=chat_body(max_tokens=1))
    wait_until(lambda: is_idle(served))
    stats = client.get("/v1/cache/stats").json()
    assert stats["enabled"] is True and stats["blocks"]["cached"] > 0
    reset = client.post("/v1/cache/reset").json()
    assert reset == {"object": "prompt_cache.reset", "enabled": True, "reset": True,
                     "dropped": {"blocks": stats["blocks"]["cached"], "host_blocks": 0, "disk_files": 0, "disk_bytes": 0}}
    assert client.get("/v1/cache/stats").json()["blocks"]["cached"] == 0
    off_model = engine_like(served, EngineConfig(max_num_seqs=1, ctx_size=256, enable_prefix_caching=False))
    try:
        off = start_server(off_model, ServerConfig(port=0))
        off_stats = httpx.get(off.address + "/v1/cache/stats").json()
        assert off_stats.keys() == stats.keys() and off_stats["enabled"] is False
        assert off_stats["blocks"] == {"used": 0, "free": 0, "cached": 0}
        assert httpx.post(off.address + "/v1/cache/reset").json()["reset"] is False
        off.stop()
    finally:
        off_model.close(10)
