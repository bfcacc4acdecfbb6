"""What llama.cpp's own server tests (tools/server/tests) read, through the real server on SmolLM2.

Each test here failed before the fix it names (issue 16, bench/RELIABILITY.md "llama.cpp server
tests"): llama-server's `llamacpp:*` metric names with their TYPE and HELP lines and honest values,
the `Process-Start-Time-Unix` header in llama-server's casing on the wire, /slots' `next_token`
list, and `seed` in /props' default generation settings; from the later rerun, `draft_n` /
`draft_n_accepted` in the timings of a speculating request and the `spec_decode_*` counters
(test_speculative), and every --alias accepted as the model of /v1/messages (test_compat_anthropic,
whose requests name the model "test"). The rerun's `return_progress` gap (the "0 %" event before
the first prefill chunk) is tested in test_prompt_progress.py with the rest of that feature.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx
import pytest

from mlxcel.config import EngineConfig, SpeculativeConfig
from mlxcel.serving.served_model import ServedModel
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread

from .conftest import engine_like

pytestmark = pytest.mark.slow

CONFIG = ServerConfig(port=0, endpoint_metrics=True, endpoint_props=True)
COUNTERS = ("prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total", "tokens_predicted_total",
            "tokens_predicted_seconds_total", "n_decode_total", "n_tokens_max", "spec_decode_num_draft_tokens_total",
            "spec_decode_num_accepted_tokens_total", "spec_decode_num_drafts_total")
GAUGES = ("prompt_tokens_seconds", "predicted_tokens_seconds", "requests_processing", "requests_deferred",
          "n_busy_slots_per_decode")


def llamacpp_metrics(text: str) -> dict[str, tuple[str, float]]:
    """{name: (type, value)} of the unlabelled `llamacpp:*` samples, each with its own TYPE line."""
    types: dict[str, str] = {}
    values: dict[str, tuple[str, float]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE llamacpp:"):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line.startswith("llamacpp:"):
            name, value = line.split(" ", 1)
            values[name] = (types[name], float(value))  # KeyError: a sample without a TYPE line of its name
    return values


@pytest.fixture()
def fresh(served: ServedModel, start_server: Callable[..., ServerThread]) -> httpx.Client:
    """A new app (its own metrics) over the session's engine."""
    return httpx.Client(base_url=start_server(served, CONFIG).address, timeout=120)


def test_metrics_carry_llama_servers_names_types_and_totals(fresh: httpx.Client) -> None:
    timings = []
    prompt = "the quick brown fox jumps over the lazy dog " * 4  # over one 16-token block: the second is cached
    for n_predict in (1, 4):
        reply = fresh.post("/completion", json={"prompt": prompt, "n_predict": n_predict, "temperature": 0})
        timings.append(reply.json()["timings"])
    assert timings[1]["cache_n"] > 0
    text = fresh.get("/metrics").text
    metrics = llamacpp_metrics(text)
    for name in COUNTERS:
        assert metrics[f"llamacpp:{name}"][0] == "counter" and f"# HELP llamacpp:{name} " in text
    for name in GAUGES:
        assert metrics[f"llamacpp:{name}"][0] == "gauge" and f"# HELP llamacpp:{name} " in text
    assert metrics["llamacpp:tokens_predicted_total"][1] == sum(t["predicted_n"] for t in timings) == 5
    assert metrics["llamacpp:prompt_tokens_total"][1] == sum(t["prompt_n"] for t in timings)
    assert metrics["llamacpp:prompt_tokens_cached_total"][1] == sum(t["cache_n"] for t in timings)
    assert metrics["llamacpp:n_decode_total"][1] >= 5 and metrics["llamacpp:n_tokens_max"][1] >= 5
    assert metrics["llamacpp:requests_processing"][1] == 0 and metrics["llamacpp:requests_deferred"][1] == 0
    assert metrics["llamacpp:predicted_tokens_seconds"][1] > 0  # 3 decode steps since the last scrape
    again = llamacpp_metrics(fresh.get("/metrics").text)
    assert again["llamacpp:predicted_tokens_seconds"][1] == 0.0  # a scrape starts a new bucket, as llama-server's
    assert again["llamacpp:tokens_predicted_total"][1] == 5  # the totals stay


def test_metrics_start_time_header_keeps_llama_servers_casing(fresh: httpx.Client) -> None:
    address = urlsplit(str(fresh.base_url))
    with socket.create_connection((address.hostname, address.port), timeout=30) as conn:
        conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            head += conn.recv(4096)
    assert b"\r\nProcess-Start-Time-Unix: " in head  # the suite reads it case-sensitively


def test_slots_next_token_is_a_list_without_the_last_tasks_budget(fresh: httpx.Client) -> None:
    assert fresh.post("/completion", json={"prompt": "I believe", "n_predict": 3}).status_code == 200
    for slot in fresh.get("/slots").json():
        assert slot["is_processing"] is False
        assert slot["next_token"] == [{"has_next_token": False, "n_remain": -1, "n_decoded": 0}]


def test_props_default_generation_settings_name_the_seed(fresh: httpx.Client) -> None:
    params = fresh.get("/props").json()["default_generation_settings"]["params"]
    assert params["seed"] == 4294967295 and params["n_predict"] == -1  # llama-server's "random" and "no limit"


def test_completion_response_fields_keep_only_the_named_paths(client: httpx.Client) -> None:
    fields = ["content", "generation_settings/n_predict", "prompt", "timings/nope"]
    body = client.post("/completion", json={"prompt": "I believe", "n_predict": 3, "response_fields": fields}).json()
    assert set(body) == {"content", "generation_settings/n_predict", "prompt"}  # a missing path is left out
    assert body["generation_settings/n_predict"] == 3 and body["prompt"] == "I believe"


def test_openai_replies_carry_a_system_fingerprint(client: httpx.Client) -> None:
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    text = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    with client.stream("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True}) as stream:
        first = next(line for line in stream.iter_lines() if line.startswith("data: "))
    for fingerprint in (chat.json()["system_fingerprint"], text.json()["system_fingerprint"],
                        json.loads(first[6:])["system_fingerprint"]):
        assert fingerprint.startswith("b")  # llama-server's `b<build>-<commit>` shape, which its tests check


def test_chat_replies_carry_timings_and_a_null_role_chunk_content(client: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    reply = client.post("/v1/chat/completions", json=body).json()
    assert reply["timings"]["predicted_n"] == reply["usage"]["completion_tokens"]
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=stream_body) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert all(c["choices"][0]["delta"].get("content") != "" for c in chunks if c["choices"])  # never an empty delta
    assert chunks[-1]["choices"] == [] and chunks[-1]["timings"]["predicted_n"] == chunks[-1]["usage"]["completion_tokens"]


def test_server_n_predict_and_seed_fill_the_requests_that_set_none(
        served: ServedModel, start_server: Callable[..., ServerThread]) -> None:
    """-n is llama-server's default, not a cap: a request's own n_predict wins (test_speculative's
    test_with_ctx_shift asks 256 of a -n 64 server)."""
    model = engine_like(served, EngineConfig(max_num_seqs=1, ctx_size=512, n_predict=4, seed=42))
    try:
        with httpx.Client(base_url=start_server(model, CONFIG).address, timeout=120) as http:
            body = {"prompt": "Once upon a time", "temperature": 1.0}  # no n_predict, no seed
            first, second = (http.post("/completion", json=body).json() for _ in range(2))
            own = http.post("/completion", json={**body, "n_predict": 6, "ignore_eos": True}).json()
            params = http.get("/props").json()["default_generation_settings"]["params"]
            live = http.get("/v1/settings").json()["settings"]
    finally:
        model.close(30)
    assert first["tokens_predicted"] == 4 and first["stop_type"] == "limit" and own["tokens_predicted"] == 6
    assert first["content"] == second["content"]  # sampled at temperature 1 with the server's seed both times
    assert (params["seed"], params["n_predict"]) == (42, 4)
    assert (live["default_seed"], live["default_n_predict"]) == (42, 4)  # the table shows what the engine runs


def test_chat_verbose_carries_the_native_reply_with_the_rendered_prompt(client: httpx.Client) -> None:
    body = {"messages": [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}],
            "max_tokens": 2}
    verbose = client.post("/v1/chat/completions", json={**body, "verbose": True}).json()
    assert "Book" in verbose["__verbose"]["prompt"] and "<|im_start|>" in verbose["__verbose"]["prompt"]
    assert verbose["__verbose"]["content"] == verbose["choices"][0]["message"]["content"]
    assert verbose["__verbose"]["tokens_predicted"] == verbose["usage"]["completion_tokens"]
    assert "__verbose" not in client.post("/v1/chat/completions", json={**body, "verbose": False}).json()


def test_models_list_every_alias_and_tag(served: ServedModel, start_server: Callable[..., ServerThread]) -> None:
    config = ServerConfig(port=0, alias="tinyllama-2, fim,code", tags=("chat", "fim", "small"))
    with httpx.Client(base_url=start_server(served, config).address, timeout=120) as http:
        card = http.get("/v1/models").json()["data"][0]
        by_alias = http.get("/v1/models/fim")
        reply = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).json()
    assert card["id"] == "code"  # the first name in sorted order, as llama-server's std::set
    assert card["aliases"] == ["code", "fim", "tinyllama-2"] and card["tags"] == ["chat", "fim", "small"]
    assert by_alias.status_code == 200 and by_alias.json()["id"] == "code"
    assert reply["model"] == "code"


def test_ignore_eos_lists_the_suppressed_end_tokens_in_the_settings(client: httpx.Client) -> None:
    body = {"prompt": "Once upon a time", "n_predict": 2, "temperature": 0}
    ignoring = client.post("/completion", json={**body, "ignore_eos": True}).json()["generation_settings"]
    plain = client.post("/completion", json=body).json()["generation_settings"]
    assert ignoring["logit_bias"] and all(entry["bias"] is None for entry in ignoring["logit_bias"])  # -inf
    assert plain["logit_bias"] == []


def test_speculating_completion_times_its_drafts_and_metrics_count_them(
        served: ServedModel, start_server: Callable[..., ServerThread]) -> None:
    """llama.cpp test_speculative reads `timings.draft_n`; /metrics' spec_decode_* counters were always 0."""
    lookup = SpeculativeConfig(draft_kind="prompt-lookup", draft_max=8)
    model = engine_like(served, EngineConfig(max_num_seqs=1, ctx_size=512, speculative=lookup))
    try:
        with httpx.Client(base_url=start_server(model, CONFIG).address, timeout=180) as http:
            body = {"prompt": "one two three four five six seven eight " * 4, "n_predict": 16, "temperature": 0}
            timings = http.post("/completion", json=body).json()["timings"]
            plain = http.post("/completion", json={**body, "prompt": "Hi"}).json()["timings"]
            metrics = llamacpp_metrics(http.get("/metrics").text)
    finally:
        model.close(30)
    assert timings["draft_n"] > 0 and 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
    assert metrics["llamacpp:spec_decode_num_draft_tokens_total"][1] >= timings["draft_n"]
    assert metrics["llamacpp:spec_decode_num_accepted_tokens_total"][1] >= timings["draft_n_accepted"]
    assert metrics["llamacpp:spec_decode_num_drafts_total"][1] >= 1
    assert "draft_n" not in plain or plain["draft_n"] > 0  # llama-server: only once a draft was verified


def test_anthropic_messages_take_every_alias_of_the_model(
        served: ServedModel, start_server: Callable[..., ServerThread]) -> None:
    config = ServerConfig(port=0, alias="tinyllama-2-anthropic,test")  # the id is "test", sorted first
    body = {"max_tokens": 1, "messages": [{"role": "user", "content": "Say hello"}]}
    with httpx.Client(base_url=start_server(served, config).address, timeout=120) as http:
        by_alias = http.post("/v1/messages", json={**body, "model": "tinyllama-2-anthropic"})
        counted = http.post("/v1/messages/count_tokens", json={**body, "model": "tinyllama-2-anthropic"})
        other = http.post("/v1/messages", json={**body, "model": "gpt-4o"})
    assert by_alias.status_code == 200 and by_alias.json()["model"] == "tinyllama-2-anthropic"
    assert counted.status_code == 200
    assert other.status_code == 200 and other.json()["model"] == "gpt-4o"  # any name, as OpenAI's (issue 26)
