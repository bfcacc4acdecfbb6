"""Issue 44 point 2: a failure anywhere in one request's path ends that request only.

A real `mlxcel-server` process on the padded-vocabulary tiny model, with faults injected (tests/server/
faults.py) at the engine step, the sampler, the detokenizer, logprobs, the output parser, the engine's
hand-over of events (in one process, and from the engine process with `--engine-process on`) and two
protocol encoders. Eight requests over every protocol run at once; one chooses a fault. It gets its
protocol's error (an SSE error event then the end, or a 500 envelope), the seven others finish with the
text they give without faults, /metrics counts the failure, /health stays ok, and SIGTERM exits 0.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from .faults import ENCODER_NUM_TOKENS, ENCODER_TOP_LOGPROBS, FAULT_TOP_K
from .padded_vocab_model import write_padded_vocab_model
from .test_engine_process import SplitServer as Server
from .test_engine_process import start_split

pytestmark = pytest.mark.slow
REPO = str(Path(__file__).resolve().parents[2])
BOOT = (f"import sys; sys.path.insert(0, {REPO!r}); from tests.server import faults; faults.install(); "
        "from mlxcel.cli import server_main; sys.exit(server_main())")
MAX_TOKENS = 16
ANSWER = "b" * (MAX_TOKENS // 2)  # the model's greedy answer: a padded id, then "b", eight times
# (protocol, streamed) of the eight concurrent requests
REQUESTS = (("chat", True), ("chat", False), ("completions", True), ("completion", False), ("responses", True),
            ("messages", True), ("messages", False), ("completion", True))
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "completion": "/completion",
         "responses": "/v1/responses", "messages": "/v1/messages"}


@dataclass(frozen=True)
class Outcome:
    status: int
    text: str
    error: dict | None  # the protocol's error object, when the request failed


@pytest.fixture(scope="module", params=["off", "on"], ids=["engine-process-off", "engine-process-on"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = write_padded_vocab_model(tmp_path_factory.mktemp("faults") / "model")
    server = start_split("-m", str(folder), "-np", "8", mode=request.param, boot=BOOT)
    yield server
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait()


def request_body(protocol: str, stream: bool, top_k: int = 0, **extra: object) -> dict:
    common = {"temperature": 0, "stream": stream, **({"top_k": top_k} if top_k else {}), **extra}
    user = [{"role": "user", "content": "hi"}]
    bodies = {"chat": {"messages": user, "max_tokens": MAX_TOKENS, "logprobs": True, "top_logprobs": 2},
              "completions": {"prompt": "hi", "max_tokens": MAX_TOKENS, "logprobs": 2},
              "completion": {"prompt": "hi", "n_predict": MAX_TOKENS, "n_probs": 2},
              "responses": {"input": "hi", "max_output_tokens": MAX_TOKENS, "store": False},
              "messages": {"model": "claude-x", "messages": user, "max_tokens": MAX_TOKENS}}
    return {**bodies[protocol], **common}


async def send(http: httpx.AsyncClient, protocol: str, stream: bool, body: dict) -> Outcome:
    if not stream:
        reply = await http.post(PATHS[protocol], json=body)
        data = reply.json()
        return Outcome(reply.status_code, _text(protocol, data) if reply.status_code == 200 else "",
                       data.get("error"))
    async with http.stream("POST", PATHS[protocol], json=body) as reply:
        lines = [line async for line in reply.aiter_lines()]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    errors = [e.get("error") or e["response"]["error"] for e in events
              if "error" in e or e.get("type") == "response.failed"]
    if protocol in ("chat", "completions") and errors:
        assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]", lines[-3:]  # then the end
    if errors:
        assert events[-1].get("error") or events[-1].get("type") == "response.failed", events[-1]
    return Outcome(reply.status_code, "".join(_piece(protocol, e) for e in events), errors[0] if errors else None)


def _text(protocol: str, data: dict) -> str:
    if protocol in ("chat", "completions"):
        choice = data["choices"][0]
        return choice["message"]["content"] if protocol == "chat" else choice["text"]
    if protocol == "completion":
        return data["content"]
    if protocol == "messages":
        return "".join(block.get("text", "") for block in data["content"])
    return data["output"][0]["content"][0]["text"]


def _piece(protocol: str, event: dict) -> str:
    if protocol == "chat":
        return "".join(c["delta"].get("content") or "" for c in event.get("choices", []))
    if protocol == "completions":
        return "".join(c["text"] for c in event.get("choices", []))
    if protocol == "completion":
        return "" if event.get("stop") or "error" in event else event["content"]
    if protocol == "messages":
        return event["delta"].get("text", "") if event.get("type") == "content_block_delta" else ""
    return event.get("delta", "") if event.get("type") == "response.output_text.delta" else ""


def run_eight(server: Server, marked: int, fault: dict) -> list[Outcome]:
    async def main() -> list[Outcome]:
        async with httpx.AsyncClient(base_url=server.address, timeout=120) as http:
            calls = [send(http, protocol, stream, request_body(protocol, stream, **(fault if i == marked else {})))
                     for i, (protocol, stream) in enumerate(REQUESTS)]
            return await asyncio.gather(*calls)

    return asyncio.run(main())


def failed_total(server: Server) -> float:
    text = httpx.get(server.address + "/metrics").text
    return sum(float(v) for v in re.findall(r"^mlxcel_requests_failed_total\{[^}]*\} (\S+)$", text, re.MULTILINE))


def assert_protocol_error(protocol: str, stream: bool, outcome: Outcome) -> None:
    assert outcome.error is not None, outcome
    if not stream:
        assert outcome.status == 500, outcome
    if protocol == "messages":
        assert outcome.error["type"] == "api_error", outcome  # inside {"type": "error", "error": {...}}
    elif protocol == "responses":
        assert outcome.error["code"] == "server_error", outcome
    else:
        assert outcome.error["type"] == "server_error" and outcome.error["code"] == 500, outcome


def check_one_fails(server: Server, marked: int, fault: dict) -> None:
    before = failed_total(server)
    outcomes = run_eight(server, marked, fault)
    protocol, stream = REQUESTS[marked]
    assert_protocol_error(protocol, stream, outcomes[marked])
    others = [o for i, o in enumerate(outcomes) if i != marked]
    assert [(o.status, o.text, o.error) for o in others] == [(200, ANSWER, None)] * 7
    assert failed_total(server) == before + 1
    assert httpx.get(server.address + "/health").json()["status"] == "ok"


# (stage, the request of the eight that chooses it): every protocol's error shape is met once
ENGINE_SIDE = [("engine step", 0), ("sampler", 3)]
API_SIDE = [("detokenization", 7), ("logprobs", 2), ("output parser", 5), ("hand-over", 1)]


@pytest.mark.parametrize("stage, marked", API_SIDE + ENGINE_SIDE)
def test_a_fault_at_one_stage_fails_one_request_of_eight(server: Server, stage: str, marked: int) -> None:
    if stage in dict(ENGINE_SIDE) and "--engine-process" in server.process.args and \
            server.process.args[server.process.args.index("--engine-process") + 1] == "on":
        pytest.skip("the engine-side faults are installed in the API process only")
    check_one_fails(server, marked, {"top_k": FAULT_TOP_K[stage]})


def test_a_failing_encoder_fails_its_request_only(server: Server) -> None:
    check_one_fails(server, 0, {"top_logprobs": ENCODER_TOP_LOGPROBS})  # chat, streamed
    check_one_fails(server, 6, {"max_tokens": ENCODER_NUM_TOKENS})  # Messages, not streamed
    assert "Traceback" in "".join(server.log) and "injected fault" in "".join(server.log)


def test_the_faults_were_logged_with_their_request_ids_and_sigterm_exits_0(server: Server) -> None:
    log = "".join(server.log)
    assert re.search(r"request (chatcmpl|cmpl|msg|resp)[-_][0-9a-zA-Z_-]+ failed: InjectedFault", log), log[-3000:]
    server.process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert server.process.wait(60) == 0
    print(f"SIGTERM to exit: {time.monotonic() - started:.2f} s")
