"""The embedding worker under a bounded loopback load (spec I): queue depth 1, one input per
forward and a 0.25 s request timeout, so one long request keeps the worker busy for seconds.
A full queue answers 503 at once, a request past the timeout 504, and chat keeps answering
from its own engine thread the whole time."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mlxcel.loading import resolve_model
from mlxcel.serving.served_model import ServedModel
from mlxcel.server.lifecycle import ServerThread
from mlxcel.server.state import ServerState
from mlxcel.serving.side_models import SideModels, load_side_models, plan_process, side_model_options
from tests.server.conftest import SERVER, chat_body, wait_until
from tests.workers.tiny_checkpoints import minilm_dir  # noqa: F401 - a fixture

pytestmark = pytest.mark.slow

TIMEOUT_S = 0.25
LONG = " ".join(["The giant panda lives in the bamboo forests of central China and eats bamboo."] * 14)
HEAVY = {"input": [LONG] * 40}  # 40 forwards of ~230 tokens each: seconds of work at batch size 1


@pytest.fixture(scope="module")
def side(minilm_dir: Path) -> Iterator[SideModels]:  # noqa: F811
    options = side_model_options(embedding_model=str(minilm_dir), embedding_batch_size=1, queue_depth=1,
                                 request_timeout_s=TIMEOUT_S)
    side = load_side_models(plan_process(None, options, resolve_model), options, int(time.time()))
    yield side
    assert side.stop(60)


@pytest.fixture(scope="module")
def address(served: ServedModel, side: SideModels) -> Iterator[str]:
    thread = ServerThread(ServerState(SERVER, served, side=side)).start()
    yield thread.address
    thread.stop()


def test_i_queue_full_503_timeout_504_and_chat_keeps_answering(address: str, side: SideModels) -> None:
    stats = side.stats
    pool = concurrent.futures.ThreadPoolExecutor(2)
    with httpx.Client(base_url=address, timeout=60) as http:
        running = pool.submit(http.post, "/v1/embeddings", json=HEAVY)
        wait_until(lambda: stats()[0].num_requests == 1 and stats()[0].queue_depth == 0, what="first request taken")
        queued = pool.submit(http.post, "/v1/embeddings", json=HEAVY)
        wait_until(lambda: stats()[0].queue_depth == 1, what="second request queued")

        refused = http.post("/v1/embeddings", json={"input": "one more"})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "queue is full" in refused.json()["error"]["message"]

        chat = http.post("/v1/chat/completions", json=chat_body(max_tokens=4))
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]
        # the embedding worker was saturated all along: the queued request still waits, or its deadline passed
        # while the chat ran (a slow machine) and it was answered 504 where it waited (issue 47)
        assert stats()[0].queue_depth + stats()[0].num_timed_out >= 1

        for future in (running, queued):
            late = future.result()
            assert late.status_code == 504 and late.json()["error"]["type"] == "timeout_error"
            assert f"longer than {TIMEOUT_S:g} s" in late.json()["error"]["message"]
        metrics = http.get("/metrics").text
    pool.shutdown()
    assert 'mlxcel_worker_rejected_total{worker="embedding"} 1.0' in metrics
    assert 'mlxcel_worker_timed_out_total{worker="embedding"} 2.0' in metrics
