"""Issue 44 point 1: ids past the tokenizer (a padded embedding) are served on every protocol.

A tiny random llama with 128 embedding rows over a 96-token tokenizer (padded_vocab_model.py): greedy, it
answers PAD_ID, "b", PAD_ID, "b", ...; logit_bias forces another padded id. Chat, completions, /completion,
Responses and Messages, streamed and not, with logprobs / top_logprobs 20 / echo / n_probs / stop strings,
each finish with defined output: a padded id's text and bytes are empty (as llama.cpp's token_to_piece
gives its UNUSED `[PAD{id}]` tokens, and vLLM's decode of an id the tokenizer lacks), through the real
server on port 0, with the engine in this process and in its own (`--engine-process on`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mlxcel.config import EngineConfig
from mlxcel.loading import resolve_model
from mlxcel.serving.chat_model import start_served_model
from mlxcel.serving.served_model import RuntimeOptions
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread
from mlxcel.server.state import ServerState

from .padded_vocab_model import B_ID, NUM_ROWS, PAD_ID, write_padded_vocab_model

pytestmark = pytest.mark.slow
OTHER_PAD_ID = NUM_ROWS - 1  # forced by logit_bias
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module", params=["off", "on"], ids=["engine-process-off", "engine-process-on"])
def http(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    folder = write_padded_vocab_model(tmp_path_factory.mktemp("padded") / "model")
    served = start_served_model(resolve_model(str(folder)), RuntimeOptions(warmup=False, engine_process=request.param),
                                EngineConfig(max_num_seqs=4, ctx_size=1024))
    thread = ServerThread(ServerState(ServerConfig(port=0, endpoint_metrics=True), served)).start()
    try:
        with httpx.Client(base_url=thread.address, timeout=120) as client:
            yield client
    finally:
        thread.stop()
        served.close(30)


def sse_data(http: httpx.Client, path: str, body: dict) -> list[dict]:
    """The JSON of every `data:` line of a stream (the [DONE] line left out)."""
    with http.stream("POST", path, json={**body, "stream": True}) as reply:
        assert reply.status_code == 200, reply.read()
        lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def assert_no_error(events: list[dict]) -> None:
    assert not [e for e in events if "error" in e or e.get("type") in ("error", "response.failed")], events[-2:]


def assert_padded_entries(entries: list[dict], key: str = "top_logprobs") -> None:
    """Entries with empty text have no bytes; at least one of them (a padded id) is there."""
    tops = [t for e in entries for t in e[key]]
    assert any(e["token"] == "" for e in entries + tops)
    assert all(e["bytes"] == [] for e in entries + tops if e["token"] == "")


def test_chat_with_top_logprobs_20_streamed_and_not(http: httpx.Client) -> None:
    body = {"messages": USER, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 20}
    reply = http.post("/v1/chat/completions", json=body).json()
    choice = reply["choices"][0]
    assert choice["message"]["content"] == "bbb" and choice["finish_reason"] == "length"
    entries = choice["logprobs"]["content"]
    assert [e["token"] for e in entries] == ["", "b"] * 3 and all(len(e["top_logprobs"]) == 20 for e in entries)
    assert_padded_entries(entries)
    events = sse_data(http, "/v1/chat/completions", body)
    assert_no_error(events)
    streamed = [c for e in events for c in e["choices"]]
    assert "".join(c["delta"].get("content") or "" for c in streamed) == "bbb"
    assert [e["token"] for c in streamed if c["logprobs"] for e in c["logprobs"]["content"]] == ["", "b"] * 3
    assert streamed[-1]["finish_reason"] == "length"


def test_chat_logit_bias_forcing_a_padded_id(http: httpx.Client) -> None:
    body = {"messages": USER, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 3,
            "logit_bias": {str(OTHER_PAD_ID): 100}}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["message"]["content"] == "" and choice["finish_reason"] == "length"
    assert [(e["token"], e["bytes"]) for e in choice["logprobs"]["content"]] == [("", [])] * 4
    events = sse_data(http, "/v1/chat/completions", body)
    assert_no_error(events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_completions_echo_logprobs_and_stop_strings_across_padded_ids(http: httpx.Client) -> None:
    body = {"prompt": [ord("H") - 32, PAD_ID, ord("R") - 32], "max_tokens": 4, "temperature": 0, "logprobs": 5,
            "echo": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == "HRbb" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["H", "", "R", "", "b", "", "b"]
    events = sse_data(http, "/v1/completions", body)
    assert_no_error(events)
    assert "".join(c["text"] for e in events for c in e["choices"]) == "HRbb"
    # "bb" is split by a padded id in the tokens, never in the text: the stop string still matches
    stopped = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "temperature": 0,
                                                  "stop": ["bb"]}).json()
    assert stopped["choices"][0]["text"] == "" and stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 4  # PAD, b, PAD, b: the match ends the text there
    biased = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0, "logprobs": 2,
                                                 "logit_bias": {str(OTHER_PAD_ID): 100}}).json()["choices"][0]
    assert biased["text"] == "" and biased["logprobs"]["tokens"] == ["", "", ""]


def test_llama_server_completion_n_probs_and_tokens(http: httpx.Client) -> None:
    body = {"prompt": "hi", "n_predict": 4, "temperature": 0, "n_probs": 5, "return_tokens": True}
    reply = http.post("/completion", json=body).json()
    assert reply["content"] == "bb" and reply["tokens"] == [PAD_ID, B_ID, PAD_ID, B_ID]
    probs = reply["completion_probabilities"]
    assert [p["id"] for p in probs] == [PAD_ID, B_ID, PAD_ID, B_ID]
    assert_padded_entries(probs)
    events = sse_data(http, "/completion", body)
    assert_no_error(events)
    assert "".join(e["content"] for e in events if not e.get("stop")) == "bb"
    assert [t for e in events if not e.get("stop") for t in e["tokens"]] == [PAD_ID, B_ID, PAD_ID, B_ID]
    biased = http.post("/completion", json={**body, "logit_bias": [[OTHER_PAD_ID, 100]]}).json()
    assert biased["content"] == "" and biased["tokens"] == [OTHER_PAD_ID] * 4


def test_responses_with_top_logprobs_20(http: httpx.Client) -> None:
    body = {"input": "hi", "max_output_tokens": 6, "temperature": 0, "top_logprobs": 20,
            "include": ["message.output_text.logprobs"], "store": False}
    reply = http.post("/v1/responses", json=body).json()
    assert reply["status"] == "incomplete" and reply["output"][0]["content"][0]["text"] == "bbb"
    events = sse_data(http, "/v1/responses", body)
    assert_no_error(events)
    assert "".join(e.get("delta", "") for e in events if e["type"] == "response.output_text.delta") == "bbb"
    assert events[-1]["type"] == "response.incomplete"


def test_messages_streamed_and_not(http: httpx.Client) -> None:
    body = {"model": "claude-x", "max_tokens": 6, "temperature": 0, "messages": USER}
    reply = http.post("/v1/messages", json=body).json()
    assert reply["content"] == [{"type": "text", "text": "bbb"}] and reply["stop_reason"] == "max_tokens"
    events = sse_data(http, "/v1/messages", body)
    assert_no_error(events)
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert text == "bbb" and events[-1]["type"] == "message_stop"


def test_tokenize_and_detokenize_padded_ids(http: httpx.Client) -> None:
    assert http.post("/detokenize", json={"tokens": [B_ID, PAD_ID, B_ID]}).json()["content"] == "bb"
    outside = http.post("/detokenize", json={"tokens": [NUM_ROWS]})
    assert outside.status_code == 400 and str(NUM_ROWS - 1) in outside.json()["error"]["message"]
    pieces = http.post("/tokenize", json={"content": "b", "with_pieces": True}).json()["tokens"]
    assert pieces == [{"id": B_ID, "piece": "b"}]
    echoed = http.post("/v1/completions", json={"prompt": [PAD_ID, B_ID], "max_tokens": 0, "echo": True,
                                                 "logprobs": 1}).json()["choices"][0]
    assert echoed["text"] == "b" and echoed["logprobs"]["tokens"] == ["", "b"]
