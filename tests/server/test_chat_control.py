"""F5 live control: POST /v1/chat/completions/control (llama-server's `reasoning_control`), through
the real HTTP server.

The model is scripted_model.py's tiny llama with one change: its reasoning never ends by itself
(" Paris weather.\\n" is followed by "Let me think." again), so only `max_tokens` or a control
action can end it. After `</think>` it continues as scripted: `\\n\\n<tool_call>...</tool_call>`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import load_file, save_file

from mlxcel.config import EngineConfig
from mlxcel.serving.chat_model import start_served_model
from mlxcel.serving.served_model import RuntimeOptions, ServedModel
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread
from tests.server.scripted_model import REASONING, write_scripted_model

QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
CONTROL = "/v1/chat/completions/control"
LONG = 3000  # max_tokens that a looping reasoning would take seconds to use up


def write_looping_model(folder: Path) -> Path:
    """scripted_model.py's checkpoint whose reasoning loops: its last piece leads back to its first."""
    write_scripted_model(folder)
    vocab = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab}
    tensors = load_file(str(folder / "model.safetensors"))
    head = tensors["lm_head.weight"]  # [vocab, hidden]: head[next, current] = 1
    last, first = ids[REASONING[-1]], ids[REASONING[0]]
    head[:, last] = 0.0
    head[first, last] = 1.0
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def looping(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedModel]:
    from mlxcel.loading import resolve_model

    folder = write_looping_model(tmp_path_factory.mktemp("looping") / "model")
    model = start_served_model(resolve_model(str(folder)), RuntimeOptions(warmup=False, quantize="off"),
                               EngineConfig(max_num_seqs=4, ctx_size=4 * 4096))
    yield model
    model.close(30)


@pytest.fixture(scope="module")
def looping_server(looping: ServedModel, start_server: Callable[..., ServerThread]) -> ServerThread:
    return start_server(looping)


@pytest.fixture()
def http(looping_server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=looping_server.address, timeout=60) as client:
        yield client


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": QUESTION, "temperature": 0, "stream": True, **fields}


def sse_chunks(reply: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in reply.iter_lines():
        if line.startswith("data: {"):
            yield json.loads(line[6:])


class Transcript:
    """A streamed chat completion's choices: reasoning, content and finish reason per index."""

    def __init__(self) -> None:
        self.reasoning: dict[int, list[str]] = {}
        self.content: dict[int, str] = {}
        self.finish: dict[int, str | None] = {}

    def add(self, chunk: dict[str, Any]) -> None:
        for choice in chunk["choices"]:
            index, delta = choice["index"], choice["delta"]
            if delta.get("reasoning_content"):
                self.reasoning.setdefault(index, []).append(delta["reasoning_content"])
            self.content[index] = self.content.get(index, "") + (delta.get("content") or "")
            self.finish[index] = choice["finish_reason"] or self.finish.get(index)


def run_with_control(http: httpx.Client, body: dict[str, Any], action: dict[str, Any] | None = None, *,
                     leave_after_control: bool = False) -> tuple[Transcript, httpx.Response | None, str]:
    """Stream `body`; after the first reasoning delta POST the control `action` (its id filled in).
    `leave_after_control` disconnects right after it (the server then aborts the completion)."""
    transcript, answer, completion_id = Transcript(), None, ""
    with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.status_code == 200
        for chunk in sse_chunks(reply):
            completion_id = chunk["id"]
            transcript.add(chunk)
            if action is not None and answer is None and transcript.reasoning:
                answer = http.post(CONTROL, json={"id": completion_id, **action})
                if leave_after_control:
                    break
    return transcript, answer, completion_id


def test_f5_without_control_the_reasoning_runs_to_max_tokens(http: httpx.Client) -> None:
    """The baseline: this model's reasoning never ends by itself."""
    transcript, _, _ = run_with_control(http, chat(max_tokens=40, reasoning_control=True))
    assert transcript.finish == {0: "length"}
    assert "".join(transcript.reasoning[0]).count(REASONING[0]) == 20  # 40 tokens, two pieces a round
    assert transcript.content[0] == ""


def test_f5_reasoning_end_forces_the_end_marker_and_the_answer_follows_on_every_choice(
    http: httpx.Client,
) -> None:
    transcript, answer, completion_id = run_with_control(
        http, chat(max_tokens=LONG, n=2, reasoning_control=True), {"action": "reasoning_end"})
    assert answer is not None and answer.status_code == 200
    assert answer.json() == {"id": completion_id, "action": "reasoning_end", "success": True,
                             "message": "reasoning ends at the next token"}
    for index in (0, 1):  # n > 1: the action reaches every choice
        assert transcript.finish[index] == "stop"
        assert transcript.content[index].startswith("<tool_call>")  # the scripted answer after </think>
        # Cut short, far below max_tokens; a choice the action reached before its first reasoning
        # token has none at all.
        assert len(transcript.reasoning.get(index, [])) < LONG // 10
    finished = http.post(CONTROL, json={"id": completion_id, "action": "reasoning_end"})
    assert finished.status_code == 200
    assert finished.json()["success"] is False  # the completion has ended: nothing to control


def test_f5_alias_path_and_unknown_id_answer_success_false(http: httpx.Client) -> None:
    """llama-server answers a well-formed call for an id that is not running with 200 and
    success false, not 404."""
    for path in (CONTROL, "/chat/completions/control"):
        reply = http.post(path, json={"id": "chatcmpl-nope", "action": "reasoning_end", "model": "any"})
        assert reply.status_code == 200
        assert reply.json() == {"id": "chatcmpl-nope", "action": "reasoning_end", "success": False,
                                "message": "no active completion for this id"}


def test_f5_a_completion_that_did_not_opt_in_is_a_400(http: httpx.Client) -> None:
    _, answer, _ = run_with_control(http, chat(max_tokens=LONG), {"action": "reasoning_end"},
                                    leave_after_control=True)
    assert answer is not None and answer.status_code == 400
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and "reasoning_control" in error["message"]


def test_f5_reasoning_control_must_be_a_boolean(http: httpx.Client) -> None:
    reply = http.post("/v1/chat/completions", json=chat(max_tokens=4, reasoning_control="yes"))
    assert reply.status_code == 400 and "reasoning_control" in reply.json()["error"]["message"]


@pytest.mark.parametrize(("body", "needle"), [
    ({"id": "chatcmpl-x", "action": "pause"}, "unknown control action"),
    ({"action": "reasoning_end"}, "id"),
    ({"id": "", "action": "reasoning_end"}, "id"),
    ({"id": "chatcmpl-x"}, "action"),
    ({"id": 7, "action": "reasoning_end"}, "id"),
    (["reasoning_end"], "JSON object"),
])
def test_f5_d1_bad_control_bodies_are_400s(http: httpx.Client, body: Any, needle: str) -> None:
    reply = http.post(CONTROL, json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and needle in error["message"]


def test_f5_d1_malformed_json_is_a_400(http: httpx.Client) -> None:
    reply = http.post(CONTROL, content=b"{not json", headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


def test_f5_model_without_reasoning_markers_is_a_400(client: httpx.Client) -> None:
    """The session's SmolLM2 has no `<think>` tokens: there is never reasoning to end."""
    reply = client.post(CONTROL, json={"id": "chatcmpl-x", "action": "reasoning_end"})
    assert reply.status_code == 400 and "reasoning markers" in reply.json()["error"]["message"]


def test_f5_c1_control_needs_the_api_key_and_checks_the_body_before_availability(
    start_server: Callable[..., ServerThread],
) -> None:
    server = start_server(None, ServerConfig(port=0, api_keys=("k",)))  # no model attached: 503 once valid
    good = {"id": "chatcmpl-x", "action": "reasoning_end"}
    with httpx.Client(base_url=server.address, timeout=30) as keyless:
        assert keyless.post(CONTROL, json=good).status_code == 401
    with httpx.Client(base_url=server.address, timeout=30, headers={"Authorization": "Bearer k"}) as keyed:
        assert keyed.post(CONTROL, json={"id": "chatcmpl-x", "action": "pause"}).status_code == 400
        assert keyed.post(CONTROL, json=good).status_code == 503
