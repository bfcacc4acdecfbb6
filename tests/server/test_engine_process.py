"""Issue 25 point 2: `--engine-process on`, the engine core in a child process, through real
`mlxcel-server` processes on the default model (port 0): the same greedy tokens as the
single-process server, no event lost with disconnects, /slots and /metrics from the child,
SIGTERM ending both processes, and a killed child failing in-flight requests cleanly.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from mlxcel.engine.remote import reap

from .conftest import chat_body, wait_until
from .test_load_disconnects import PROMPTS, STORM_TOKENS, pool_state, storm_request
from .test_process import read_address

pytestmark = pytest.mark.slow
ENGINE_PID = re.compile(r"engine process: pid (\d+) ready")
NUM_STREAMS = 16


@dataclass
class SplitServer:
    process: subprocess.Popen[str]
    address: str
    log: list[str]

    @property
    def engine_pid(self) -> int:
        wait_until(lambda: any(ENGINE_PID.search(line) for line in self.log), what="the engine pid line")
        return int(next(m for m in map(ENGINE_PID.search, self.log) if m).group(1))

    def text(self) -> str:
        return "".join(self.log)


SERVER_MAIN = "import sys; from mlxcel.cli import server_main; sys.exit(server_main())"


def start_split(*args: str, mode: str = "on", boot: str = SERVER_MAIN) -> SplitServer:
    """A real server process (`boot` is its `python -c` program), with the engine process `mode`."""
    command = [sys.executable, "-c", boot, "--port", "0", "-c", "4096", "--no-warmup", "--metrics", "--slots", "--engine-process", mode,
               "--prefix-cache-disk-size", "0", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    log: list[str] = []
    try:
        return SplitServer(process, read_address(process, log, timeout=300), log)
    except BaseException:
        process.kill()
        process.wait()
        raise


def stop(server: SplitServer) -> int:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
    return server.process.wait(120)


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited
        return stat.read().split(") ")[-1][0] != "Z"


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SplitServer]:
    server = start_split("-np", str(NUM_STREAMS), "--slot-save-path", str(tmp_path_factory.mktemp("slots")))
    yield server
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(120)


def streamed_text(http: httpx.Client, body: dict) -> str:
    text = ""
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    return text


SCHEMA = {"type": "object", "properties": {"color": {"type": "string"}, "count": {"type": "integer"}},
          "required": ["color", "count"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def replies(http: httpx.Client) -> list[object]:
    """A chat, a streamed chat, a json_schema reply and a forced tool call, all greedy."""
    body = chat_body("Name three colors", max_tokens=24)
    schema = chat_body("Give a color and a number as JSON", max_tokens=40,
                       response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}})
    tools = chat_body("What is the weather in Paris?", max_tokens=40, tools=TOOLS, tool_choice="required")
    out: list[object] = [http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"],
                         streamed_text(http, body)]
    for extra in (schema, tools):
        reply = http.post("/v1/chat/completions", json=extra)
        assert reply.status_code == 200, reply.text
        message = reply.json()["choices"][0]["message"]
        out.append([message.get("content"), message.get("tool_calls") and
                    [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]])
    return out


def test_chat_stream_and_grammars_equal_the_single_process_greedy_tokens(split: SplitServer) -> None:
    """The same flags with --engine-process off: the same greedy tokens, grammar-constrained ones included
    (their processors are rebuilt in the engine process from the grammar's text)."""
    single = start_split("-np", str(NUM_STREAMS), mode="off")
    try:
        with httpx.Client(base_url=single.address, timeout=300) as one:
            expected = replies(one)
    finally:
        assert stop(single) == 0
    with httpx.Client(base_url=split.address, timeout=300) as two:
        got = replies(two)
    assert got == expected and expected[0]
    assert json.loads(got[2][0]).keys() == {"color", "count"} and got[3][1][0][0] == "get_weather"


def test_16_streams_with_random_disconnects_lose_no_event(split: SplitServer) -> None:
    chooser = random.Random(25)
    drops = [chooser.randint(1, STORM_TOKENS) if chooser.random() < 0.35 else None for _ in range(NUM_STREAMS)]

    async def storm() -> list[tuple[str, int]]:
        async with httpx.AsyncClient(base_url=split.address, timeout=300) as http:
            return list(await asyncio.gather(*(storm_request(http, i, d) for i, d in enumerate(drops))))

    with httpx.Client(base_url=split.address, timeout=120) as http:
        free_before, *_ = pool_state(http)
        before = http.get("/health").json()["observability"]
        results = asyncio.run(storm())
        wait_until(lambda: pool_state(http)[1:] == (0, 0, True), timeout=60, what="an idle engine")
        wait_until(lambda: pool_state(http)[0] == free_before, timeout=60, what="every KV block free")
        after = http.get("/health").json()["observability"]
    done = [n for kind, n in results if kind == "done"]
    dropped = [n for kind, n in results if kind == "dropped"]
    assert len(dropped) == sum(d is not None for d in drops) and done == [STORM_TOKENS] * len(done)
    started, completed, aborted = (after[k] - before[k] for k in ("sequences_started", "sequences_completed",
                                                                     "sequences_aborted"))
    assert started == NUM_STREAMS and started == completed + aborted, (started, completed, aborted)


def metric(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_slots_and_metrics_show_the_engine_process_work(split: SplitServer) -> None:
    with httpx.Client(base_url=split.address, timeout=300) as http:
        generated = metric(http.get("/metrics").text, "mlxcel_tokens_generated_total")
        busy: list[dict] = []
        body = chat_body(PROMPTS[0], max_tokens=64, ignore_eos=True, stream=True)
        with http.stream("POST", "/v1/chat/completions", json=body) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {") and not busy:
                    busy = [s for s in http.get("/slots").json() if s["is_processing"]]
        assert busy and busy[0]["n_prompt_tokens"] > 0
        after = http.get("/metrics").text
        assert metric(after, "mlxcel_tokens_generated_total") >= generated + 64
        slot = busy[0]["id"]
        saved = http.post(f"/slots/{slot}?action=save", json={"filename": "one.bin"})
        assert saved.status_code == 200 and saved.json()["n_saved"] > 0, saved.text
        restored = http.post(f"/slots/{slot}?action=restore", json={"filename": "one.bin"})
        assert restored.status_code == 200 and restored.json()["n_restored"] == saved.json()["n_saved"]
        assert http.post(f"/slots/{slot}?action=erase").json()["n_erased"] > 0
        missing = http.post(f"/slots/{slot}?action=restore", json={"filename": "none.bin"})
        assert missing.status_code in (400, 404) and "none.bin" in missing.text  # the child's error crossed
        assert http.post("/v1/cache/reset").status_code == 200


def test_sigterm_ends_both_processes() -> None:
    server = start_split("-np", "2")
    pid = server.engine_pid
    with httpx.Client(base_url=server.address, timeout=300) as http:
        assert http.post("/v1/chat/completions", json=chat_body()).status_code == 200
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(120) == 0
    wait_until(lambda: not is_running(pid), timeout=30, what="the engine process to exit")
    assert "engine process" in server.text() and "stopped (clean)" in server.text()


def test_a_killed_engine_process_fails_every_held_request_and_a_new_one_serves() -> None:
    """Issue 44: SIGKILL mid-step; both streams it held end with an error naming the engine process, /health
    is 503 while a new engine process loads, then the next request is served by it and SIGTERM exits 0."""
    server = start_split("-np", "2")
    pid = server.engine_pid
    body = chat_body(max_tokens=900, ignore_eos=True, stream=True)

    async def stream(http: httpx.AsyncClient, started: asyncio.Event, num_started: list[int]) -> list[str]:
        lines: list[str] = []
        async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
            async for line in reply.aiter_lines():
                lines.append(line)
                if len(lines) == 6:
                    num_started.append(1)
                    if len(num_started) == 2:
                        started.set()
        return lines

    async def held_streams() -> list[list[str]]:
        async with httpx.AsyncClient(base_url=server.address, timeout=300) as http:
            started, num_started = asyncio.Event(), []
            tasks = [asyncio.create_task(stream(http, started, num_started)) for _ in range(2)]
            await started.wait()
            os.kill(pid, signal.SIGKILL)
            return await asyncio.gather(*tasks)

    try:
        for lines in asyncio.run(held_streams()):
            errors = [json.loads(x[6:])["error"] for x in lines if x.startswith("data: {") and '"error"' in x]
            assert errors and "engine process" in errors[0]["message"], lines[-4:]
            assert [x for x in lines if x][-1] == "data: [DONE]"
        with httpx.Client(base_url=server.address, timeout=300) as http:
            statuses = {http.get("/health").status_code}  # 503 while the new engine process loads
            wait_until(lambda: statuses.add(http.get("/health").status_code) or 200 in statuses, timeout=300,
                       what="the new engine process")
            assert statuses == {503, 200}
            reply = http.post("/v1/chat/completions", json=chat_body())
            assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]
        assert "exited with code -9" in server.text() and "in place of the dead one" in server.text()
        new_pids = {int(m.group(1)) for m in map(ENGINE_PID.search, server.log) if m}
        assert len(new_pids - {pid}) == 1
        assert stop(server) == 0
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


def test_a_killed_api_process_takes_the_engine_process_along() -> None:
    """No orphan: the engine process stops once its pipe to the API process closes."""
    server = start_split("-np", "2")
    pid = server.engine_pid
    server.process.kill()
    server.process.wait(30)
    wait_until(lambda: not is_running(pid), timeout=60, what="the engine process to exit")


def _exit_soon() -> None:
    time.sleep(0.05)


def test_issue25_both_waiters_of_a_stopping_engine_process_see_its_exit_code() -> None:
    """stop() and the reader thread wait for the engine process at once; the loser of waitpid's race used to
    read code None, logged "exited with code None while stopping" and made a clean SIGTERM exit 1 (H200 run)."""
    context = multiprocessing.get_context("fork")
    for _ in range(10):
        process = context.Process(target=_exit_soon)
        process.start()
        codes: list[int | None] = []
        waiters = [threading.Thread(target=lambda: codes.append(reap(process, 10))) for _ in range(2)]
        for w in waiters:
            w.start()
        for w in waiters:
            w.join()
        assert codes == [0, 0]
