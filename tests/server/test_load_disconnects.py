"""Load with disconnects and queue overflow on the real server and model (issue 16, K1, K3, A3).

400 streamed chat completions at concurrency 16, every fourth client dropping its connection after
two events: every other one completes with the same text as an unloaded run, and afterwards every
slot is idle, the KV pool's free blocks are back to their count before the load and the queue is
empty. A full queue answers 503 with Retry-After and a JSON body, then serves again. Each test
prints one `FIGURES` line for bench/RELIABILITY.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest

from mlxcel.config import EngineConfig
from mlxcel.serving.served_model import ServedModel
from mlxcel.server.lifecycle import ServerThread

from .conftest import chat_body, engine_like, wait_until

pytestmark = pytest.mark.slow
NUM_REQUESTS = int(os.environ.get("MLXCEL_LOAD_REQUESTS", "400"))
CONCURRENCY = 16
PROMPTS = ("Hi", "Hello", "Good morning", "Name a color")
MAX_TOKENS = 3


@dataclass
class LoadResult:
    num_completed: int = 0
    num_dropped: int = 0
    wrong: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def content_of(lines: list[str]) -> tuple[str, str | None]:
    text, finish = "", None
    for line in lines:
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise AssertionError(f"error event: {chunk}")
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
    return text, finish


async def one_request(http: httpx.AsyncClient, index: int, expected: dict[str, str], result: LoadResult) -> None:
    prompt = PROMPTS[index % len(PROMPTS)]
    is_dropping = index % 4 == 3
    body = chat_body(prompt, stream=True, max_tokens=MAX_TOKENS)
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                result.failed.append(f"{index}: {reply.status_code} {(await reply.aread())[:200]!r}")
                return
            lines: list[str] = []
            async for line in reply.aiter_lines():
                lines.append(line)
                if is_dropping and sum(1 for x in lines if x.startswith("data: ")) == 2:
                    result.num_dropped += 1
                    return  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as exc:
        result.failed.append(f"{index}: {exc!r}")
        return
    text, finish = content_of(lines)
    if lines[-2:] != ["data: [DONE]", ""] and lines[-1:] != ["data: [DONE]"] or finish != "length":
        result.failed.append(f"{index}: unterminated stream {lines[-3:]}")
    elif text != expected[prompt]:
        result.wrong.append(f"{index}: {text!r} != {expected[prompt]!r}")
    else:
        result.num_completed += 1


async def run_load(address: str, expected: dict[str, str]) -> LoadResult:
    result = LoadResult()
    indices: asyncio.Queue[int] = asyncio.Queue()
    for index in range(NUM_REQUESTS):
        indices.put_nowait(index)

    async def client() -> None:
        async with httpx.AsyncClient(base_url=address, timeout=120) as http:
            while not indices.empty():
                await one_request(http, indices.get_nowait(), expected, result)

    await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
    return result


@pytest.fixture(scope="module")
def load_server(served: ServedModel, start_server: Callable[..., ServerThread]) -> str:
    model = engine_like(served, EngineConfig(max_num_seqs=8, ctx_size=4096, max_queue_depth=64))
    return start_server(model).address


def pool_state(http: httpx.Client) -> tuple[int, int, int, bool]:
    health = http.get("/health").json()
    blocks = http.get("/v1/cache/stats").json()["blocks"]
    is_idle = not any(s["is_processing"] for s in http.get("/slots").json())
    return blocks["free"], health["batch"]["queue_depth"], health["batch"]["active_sequences"], is_idle


def test_load_with_disconnects_completes_the_rest_and_leaks_nothing(load_server: str) -> None:
    with httpx.Client(base_url=load_server, timeout=120) as http:
        expected = {}
        for prompt in PROMPTS:
            reply = http.post("/v1/chat/completions", json=chat_body(prompt, max_tokens=MAX_TOKENS)).json()
            expected[prompt] = reply["choices"][0]["message"]["content"]
        free_before, *_ = pool_state(http)
        started = time.monotonic()
        result = asyncio.run(run_load(load_server, expected))
        elapsed = time.monotonic() - started
        wait_until(lambda: pool_state(http)[1:] == (0, 0, True), what="an idle engine")
        wait_until(lambda: pool_state(http)[0] == free_before, what="every KV block free")
        free_after, *_ = pool_state(http)
    num_dropping = NUM_REQUESTS // 4
    assert result.failed == [] and result.wrong == []
    assert result.num_dropped == num_dropping and result.num_completed == NUM_REQUESTS - num_dropping
    print(f"FIGURES load: requests={NUM_REQUESTS} concurrency={CONCURRENCY} dropped={result.num_dropped} "
          f"completed={result.num_completed} lost={len(result.failed)} wrong={len(result.wrong)} "
          f"blocks_leaked={free_before - free_after} elapsed_s={elapsed:.1f}")


def test_queue_overflow_is_a_503_with_retry_after_then_recovers(served: ServedModel,
                                                                start_server: Callable[..., ServerThread]) -> None:
    model = engine_like(served, EngineConfig(max_num_seqs=1, ctx_size=2048, max_queue_depth=2))
    address = start_server(model).address
    body = chat_body("Write a long story", max_tokens=60, ignore_eos=True)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=address, timeout=120) as http:
            return list(await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for _ in range(8))))

    replies = asyncio.run(burst())
    full = [r for r in replies if r.status_code == 503]
    served_ok = [r for r in replies if r.status_code == 200]
    assert len(full) >= 8 - 3 and len(full) + len(served_ok) == 8
    for reply in full:
        assert int(reply.headers["Retry-After"]) >= 1 and reply.headers["content-type"] == "application/json"
        assert reply.json()["error"]["type"] == "unavailable_error" and "queue" in reply.json()["error"]["message"]
    rejected_at = time.monotonic()
    with httpx.Client(base_url=address, timeout=120) as http:
        reply = http.post("/v1/chat/completions", json=chat_body(max_tokens=2))
        recovery_s = time.monotonic() - rejected_at
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
        assert pool_state(http)[1:] == (0, 0, True)
    print(f"FIGURES overflow: burst=8 rejected_503={len(full)} served={len(served_ok)} "
          f"recovery_s={recovery_s:.2f}")


# ---- issue 25: 64 sampled streams at once, a seeded third of them cut off at random points ----

STORM_STREAMS = 64
STORM_TOKENS = 16


async def storm_request(http: httpx.AsyncClient, index: int, drop_after: int | None) -> tuple[str, int]:
    """('done', tokens seen) for a stream read to [DONE]; ('dropped', n) for one closed after n events."""
    body = chat_body(PROMPTS[index % len(PROMPTS)], stream=True, max_tokens=STORM_TOKENS, temperature=0.8, top_p=0.95,
                     ignore_eos=True, logprobs=True, stream_options={"include_usage": True})
    tokens, events, usage = 0, 0, None
    async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            events += 1
            if drop_after is not None and events >= drop_after:
                return "dropped", events
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                tokens += len((choice.get("logprobs") or {}).get("content") or [])
    assert usage is not None and usage["completion_tokens"] == STORM_TOKENS
    return "done", tokens


def test_issue25_64_sampled_streams_with_random_disconnects_lose_no_event(served: ServedModel,
                                                                         start_server: Callable[..., ServerThread]) -> None:
    """Every stream read to the end carries each of its tokens (one logprob entry per token, the
    usage count), and the engine accounts for every sequence: started = completed + aborted."""
    import random

    model = engine_like(served, EngineConfig(max_num_seqs=STORM_STREAMS, ctx_size=STORM_STREAMS * 128,
                                             max_queue_depth=STORM_STREAMS))
    address = start_server(model).address
    chooser = random.Random(25)
    drops = [chooser.randint(1, STORM_TOKENS) if chooser.random() < 0.35 else None for _ in range(STORM_STREAMS)]

    async def storm() -> list[tuple[str, int]]:
        limits = httpx.Limits(max_connections=STORM_STREAMS + 4)
        async with httpx.AsyncClient(base_url=address, timeout=300, limits=limits) as http:
            return list(await asyncio.gather(*(storm_request(http, i, d) for i, d in enumerate(drops))))

    with httpx.Client(base_url=address, timeout=120) as http:
        free_before, *_ = pool_state(http)
        before = http.get("/health").json()["observability"]
        results = asyncio.run(storm())
        wait_until(lambda: pool_state(http)[1:] == (0, 0, True), what="an idle engine")
        wait_until(lambda: pool_state(http)[0] == free_before, what="every KV block free")
        after = http.get("/health").json()["observability"]
    done = [n for kind, n in results if kind == "done"]
    dropped = [n for kind, n in results if kind == "dropped"]
    assert len(dropped) == sum(d is not None for d in drops) and len(done) + len(dropped) == STORM_STREAMS
    assert done == [STORM_TOKENS] * len(done)  # no token event lost on a stream read to the end
    started, completed, aborted = (after[k] - before[k] for k in ("sequences_started", "sequences_completed",
                                                                     "sequences_aborted"))
    assert started == STORM_STREAMS and started == completed + aborted, (started, completed, aborted)
    print(f"FIGURES storm: streams={STORM_STREAMS} dropped={len(dropped)} done={len(done)} "
          f"started={started} completed={completed} aborted={aborted}")
