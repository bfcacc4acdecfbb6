"""llama-server's `return_progress` and `timings_per_token` stream fields, through the real server on SmolLM2.

With `return_progress: true` a stream gets, before the generated text, one event before the first
prefill chunk (processed == cache: llama-server's "0 %" update, timed prompt_n 0 and prompt_ms 0)
and one after each chunk, carrying `prompt_progress` = {total, cache, processed, time_ms};
`processed` counts the cached tokens too, so the last event's equals `total` (llama.cpp
tools/server/tests test_return_progress, test_metrics_timings_on_prompt_progress).
`timings_per_token: true` puts a `timings` object on every event. Both hold on /completion,
/v1/chat/completions, /v1/completions and /v1/responses streams (there a prefill chunk is one more
`response.in_progress` event, as llama-server's test_responses_stream_with_llama_telemetry reads it).
The engine here prefills 32 tokens a step, so a 100-token prompt takes several chunks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from mlxcel.config import EngineConfig
from mlxcel.serving.served_model import ServedModel
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread

from .conftest import engine_like

pytestmark = pytest.mark.slow

CHUNK = 32
PROMPT = "This is a test of prompt progress reporting. " * 10  # ~100 tokens: several chunks of 32


@pytest.fixture(scope="module")
def chunked(served: ServedModel, start_server: Callable[..., ServerThread]) -> Iterator[httpx.Client]:
    """A server whose engine computes at most CHUNK prompt tokens a step."""
    model = engine_like(served, EngineConfig(max_num_seqs=1, ctx_size=1024, max_num_batched_tokens=CHUNK))
    try:
        with httpx.Client(base_url=start_server(model, ServerConfig(port=0)).address, timeout=120) as http:
            yield http
    finally:
        model.close(30)


def stream_events(client: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", path, json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        return [json.loads(line[6:]) for line in reply.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def check_progress(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events' prompt_progress objects, checked as llama.cpp's suite checks them."""
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert progress, "no prompt_progress event"
    for before, after in zip(progress, progress[1:]):
        assert after["total"] == before["total"] and after["cache"] == before["cache"]
        assert after["processed"] > before["processed"] and after["time_ms"] >= before["time_ms"]
    last = progress[-1]
    assert last["total"] > 0 and last["processed"] == last["total"]
    assert progress[0]["processed"] == last["cache"]  # the "0 %" event, before any chunk
    assert progress[1]["processed"] - last["cache"] <= CHUNK  # the first chunk's tokens, after the cache hit
    assert len(progress) == 1 + math.ceil((last["total"] - last["cache"]) / CHUNK)
    assert all(set(p) == {"total", "cache", "processed", "time_ms"} for p in progress)
    return progress


def test_completion_stream_reports_each_prefill_chunk_before_the_text(chunked: httpx.Client) -> None:
    events = stream_events(chunked, "/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0,
                                                    "cache_prompt": False, "return_progress": True})
    progress = check_progress(events)
    assert len(progress) >= 3 and progress[0]["cache"] == 0
    count = len(progress)
    assert all("prompt_progress" in e for e in events[:count])  # all of them first, then the text
    for event in events[:count]:
        assert event["content"] == "" and event["tokens"] == [] and event["stop"] is False
        assert event["tokens_predicted"] == 0 and event["tokens_evaluated"] == progress[-1]["total"]
    assert not any("prompt_progress" in e for e in events[count:])
    assert events[-1]["stop"] is True and events[-1]["tokens_evaluated"] == progress[-1]["total"]


def test_a_cached_prefix_counts_in_processed_and_needs_fewer_chunks(chunked: httpx.Client) -> None:
    body = {"prompt": PROMPT, "n_predict": 2, "temperature": 0, "return_progress": True}
    stream_events(chunked, "/completion", body)  # fills the prefix cache
    events = stream_events(chunked, "/completion", body)
    progress = check_progress(events)
    assert progress[-1]["cache"] > 0 and len(progress) == 2  # 0 %, then the rest of the last 16-token block
    assert events[-1]["tokens_cached"] == progress[-1]["cache"]


def test_chat_stream_progress_chunks_carry_the_role_delta_and_timings(chunked: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5, "temperature": 0,
            "cache_prompt": False, "return_progress": True, "timings_per_token": True}
    events = stream_events(chunked, "/v1/chat/completions", body)
    progress = check_progress(events)
    assert len(progress) >= 3
    with_progress = [e for e in events if "prompt_progress" in e]
    for event in with_progress:
        assert event["object"] == "chat.completion.chunk"
        assert event["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": None},
                                     "logprobs": None, "finish_reason": None}]
        timings = event["timings"]
        assert timings["predicted_n"] == 0 and timings["cache_n"] == event["prompt_progress"]["cache"]
        assert timings["prompt_n"] == event["prompt_progress"]["processed"] - event["prompt_progress"]["cache"]
    assert with_progress[0]["timings"]["prompt_n"] == 0 and with_progress[0]["timings"]["prompt_ms"] == 0.0
    prompt_ms = [e["timings"]["prompt_ms"] for e in with_progress]
    assert prompt_ms == sorted(prompt_ms) and prompt_ms[-1] > 0  # llama.cpp's timings_on_prompt_progress
    after = events[events.index(with_progress[-1]) + 1:]
    assert after and all("timings" in e for e in after)  # every chunk after the prompt: live timings
    predicted = [e["timings"]["predicted_n"] for e in after]
    assert predicted == sorted(predicted) and predicted[-1] == 5
    assert "timings" not in events[0]  # the role chunk, as llama-server's timings_per_token test reads it
    assert all(math.isfinite(v) for e in events[1:] for v in e["timings"].values())
    assert after[-1]["choices"][0]["finish_reason"] == "length"


def test_v1_completions_stream_reports_progress_then_times_every_chunk(chunked: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "cache_prompt": False, "return_progress": True,
            "timings_per_token": True, "stream_options": {"include_usage": True}}
    events = stream_events(chunked, "/v1/completions", body)
    progress = check_progress(events)
    count = len(progress)
    assert count >= 3 and all("prompt_progress" in e for e in events[:count])
    for event in events[:count]:
        assert event["object"] == "text_completion"
        assert event["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}]
        assert event["timings"]["predicted_n"] == 0 and event["timings"]["cache_n"] == event["prompt_progress"]["cache"]
    text, usage = events[count:-1], events[-1]
    assert text and all("timings" in e and "prompt_progress" not in e for e in text)
    predicted = [e["timings"]["predicted_n"] for e in text]
    assert predicted == sorted(predicted) and predicted[-1] == 4 and text[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert usage["timings"]["predicted_n"] == 4 and usage["timings"]["prompt_n"] == progress[-1]["total"]
    assert all(math.isfinite(v) for e in events for v in e["timings"].values())


def test_responses_stream_progress_is_in_progress_events_and_deltas_are_timed(chunked: httpx.Client) -> None:
    body = {"input": PROMPT, "max_output_tokens": 5, "temperature": 0, "cache_prompt": False, "store": False,
            "return_progress": True, "timings_per_token": True}
    events = stream_events(chunked, "/v1/responses", body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    progress = check_progress(events)
    assert len(progress) >= 3 and "prompt_progress" not in events[1]  # the lifecycle's own in_progress first
    for event in (e for e in events if "prompt_progress" in e):
        assert event["type"] == "response.in_progress" and event["response"]["status"] == "in_progress"
        assert event["timings"]["predicted_n"] == 0
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and all("timings" in e for e in deltas)  # a step's last event carries its timings
    predicted = [e["timings"]["predicted_n"] for e in deltas]
    assert predicted == sorted(predicted) and predicted[-1] <= 5
    final = events[-1]
    assert final["type"] == "response.incomplete"  # OpenAI: max_output_tokens ends it incomplete
    assert final["timings"]["predicted_n"] == final["response"]["usage"]["output_tokens"] == 5
    assert final["timings"]["prompt_n"] == progress[-1]["total"]


def test_responses_stream_without_the_flags_times_only_its_end(chunked: httpx.Client) -> None:
    events = stream_events(chunked, "/v1/responses", {"input": PROMPT, "max_output_tokens": 2, "store": False})
    assert not any("prompt_progress" in e or "timings" in e for e in events[:-1])
    assert [e["type"] for e in events].count("response.in_progress") == 1
    assert events[-1]["timings"]["predicted_n"] == 2  # llama-server: the final timings on the terminal event


def test_completion_timings_per_token_times_every_event(chunked: httpx.Client) -> None:
    events = stream_events(chunked, "/completion", {"prompt": "I believe", "n_predict": 4, "temperature": 0,
                                                    "timings_per_token": True})
    assert all("timings" in e and "prompt_progress" not in e for e in events)
    partials = [e for e in events if not e["stop"]]
    assert [e["timings"]["predicted_n"] for e in partials] == [e["tokens_predicted"] for e in partials]
    assert events[-1]["timings"]["predicted_n"] == 4


def test_no_progress_unless_asked_and_none_without_a_stream(chunked: httpx.Client) -> None:
    events = stream_events(chunked, "/completion", {"prompt": PROMPT, "n_predict": 2, "cache_prompt": False})
    assert not any("prompt_progress" in e or "timings" in e for e in events[:-1])
    reply = chunked.post("/completion", json={"prompt": PROMPT, "n_predict": 2, "return_progress": True})
    assert reply.status_code == 200 and "prompt_progress" not in reply.json()  # llama-server: streams only
    chat = chunked.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}],
                                                      "max_tokens": 2, "return_progress": True})
    assert chat.status_code == 200 and "prompt_progress" not in chat.json()
    legacy = chunked.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "return_progress": True})
    assert legacy.status_code == 200 and "prompt_progress" not in legacy.json()
    assert legacy.json()["timings"]["predicted_n"] == 2  # llama-server's timings beside usage, as chat
