"""A8 --decode-timeout on the real server and model, with a decode step that stalls.

The stall is test-only and outside the hot path: a TokenProcessor (the engine's per-request plug-in)
that blocks the engine thread for a few seconds at the third generated token, attached by an
EngineClient subclass to the requests the test arms it for. The client side sees no token for
longer than --decode-timeout: a 504 envelope (plain) or the protocol's error event (stream), and
once the step returns the slot and its KV blocks are free again.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Sequence

import httpx
import pytest
import torch

from mlxcel.config import EngineConfig
from mlxcel.engine.client import EngineClient, RequestStream
from mlxcel.engine.loop import EngineCore
from mlxcel.serving.served_model import ServedModel, model_shape
from mlxcel.server.lifecycle import ServerThread
from mlxcel.types import FinishReason, Request

from .conftest import chat_body, wait_until

pytestmark = pytest.mark.slow
STALL_AT = 3  # generated tokens before the stalled step
STALL_S = 8.0
DECODE_TIMEOUT_S = 2.5  # well above a normal step, even on a loaded 2-core machine


class StallingProcessor:
    """Blocks the engine thread once, in the step after STALL_AT tokens (a hung decode step)."""

    def __init__(self) -> None:
        self.has_stalled = False

    def process(self, logits: torch.Tensor, output_ids: Sequence[int]) -> None:
        if len(output_ids) == STALL_AT and not self.has_stalled:
            self.has_stalled = True
            time.sleep(STALL_S)

    def accept(self, token_id: int) -> FinishReason | None:
        return None


class StallingEngine(EngineClient):
    """An engine client that arms the next `num_armed` requests with a StallingProcessor."""

    def __init__(self, core: EngineCore) -> None:
        super().__init__(core)
        self.num_armed = 0
        self._lock = threading.Lock()

    def submit(self, request: Request) -> RequestStream:
        with self._lock:
            if self.num_armed > 0:
                self.num_armed -= 1
                request.processors = (*request.processors, StallingProcessor())
        return super().submit(request)


@pytest.fixture(scope="module")
def stalling(served: ServedModel, start_server: Callable[..., ServerThread]) -> tuple[StallingEngine, str]:
    config = EngineConfig(max_num_seqs=2, ctx_size=2048, decode_timeout_s=DECODE_TIMEOUT_S)
    core = EngineCore(served.loaded.model, model_shape(served.loaded), config,
                      eos_token_ids=served.tokenizer.eos_token_ids)
    core.start()
    engine = StallingEngine(core)
    model = dataclasses.replace(served, engine=engine, engine_config=config)
    return engine, start_server(model).address


def assert_freed(http: httpx.Client, free_before: int) -> None:
    wait_until(lambda: not any(s["is_processing"] for s in http.get("/slots").json()), what="idle slots")
    wait_until(lambda: http.get("/v1/cache/stats").json()["blocks"]["free"] == free_before, what="blocks freed")
    assert http.get("/health").json()["batch"]["queue_depth"] == 0


def test_a8_decode_timeout_plain_request_is_a_504_and_frees_the_slot(stalling: tuple[StallingEngine, str]) -> None:
    engine, address = stalling
    with httpx.Client(base_url=address, timeout=60) as http:
        free_before = http.get("/v1/cache/stats").json()["blocks"]["free"]
        engine.num_armed = 1
        started = time.monotonic()
        reply = http.post("/v1/chat/completions", json=chat_body(max_tokens=20, ignore_eos=True))
        waited = time.monotonic() - started
        assert reply.status_code == 504 and reply.json()["error"]["type"] == "timeout_error"
        assert waited < STALL_S  # answered when the timeout fired, not when the step came back
        assert_freed(http, free_before)
        after = http.post("/v1/chat/completions", json=chat_body(max_tokens=4))
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4


def test_a8_decode_timeout_in_a_stream_is_an_error_event(stalling: tuple[StallingEngine, str]) -> None:
    engine, address = stalling
    with httpx.Client(base_url=address, timeout=60) as http:
        free_before = http.get("/v1/cache/stats").json()["blocks"]["free"]
        engine.num_armed = 1
        with http.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=20, stream=True)) as reply:
            assert reply.status_code == 200
            lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert error["type"] == "timeout_error" and error["code"] == 504
        assert_freed(http, free_before)
        engine.num_armed = 1
        with http.stream("POST", "/v1/messages", json={**chat_body(max_tokens=20, stream=True),
                                                       "model": "claude-x"}) as reply:
            events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")]
        assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "timeout_error"
        assert_freed(http, free_before)
