"""Faults on the real server process and model (issue 16): kill -9 while stored responses are being
written, then a restart on the same --responses-db (F2, SQLite WAL + synchronous=FULL); SIGTERM with
streams of every protocol in flight (A7). Each test prints one `FIGURES` line for bench/RELIABILITY.md.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from .server_process import ServerProcess

pytestmark = pytest.mark.slow
NUM_WRITERS = 4
MIN_ACKNOWLEDGED = 8


def output_text(response: dict[str, Any]) -> str:
    return "".join(part.get("text", "") for item in response.get("output", []) if item.get("type") == "message"
                   for part in item.get("content", []))


def sse_events(lines: Any) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


class Writers:
    """Threads storing responses (plain and streamed) until stopped; `acknowledged` maps the id of
    every response the client saw finish to its output text."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.acknowledged: dict[str, str] = {}
        self.num_sent = 0
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._write, args=(i,), daemon=True) for i in range(NUM_WRITERS)]

    def start(self) -> Writers:
        for thread in self.threads:
            thread.start()
        return self

    def _write(self, worker: int) -> None:
        with httpx.Client(base_url=self.address, timeout=60) as http:
            for n in range(10_000):
                if self.stop.is_set():
                    return
                body = {"model": "m", "input": f"Write a word about {worker * 1000 + n}", "store": True,
                        "max_output_tokens": 6, "temperature": 0, "stream": n % 2 == 1}
                with self._lock:
                    self.num_sent += 1
                try:
                    response = self._streamed(http, body) if body["stream"] else self._plain(http, body)
                except httpx.HTTPError:
                    return  # the server is gone
                if response is not None:
                    with self._lock:
                        self.acknowledged[response["id"]] = output_text(response)

    @staticmethod
    def _plain(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any] | None:
        reply = http.post("/v1/responses", json=body)
        return reply.json() if reply.status_code == 200 else None

    @staticmethod
    def _streamed(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any] | None:
        with http.stream("POST", "/v1/responses", json=body) as reply:
            for event in sse_events(reply.iter_lines()):
                if event["type"] in ("response.completed", "response.incomplete"):
                    return event["response"]
        return None

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)


def test_kill9_while_writing_stored_responses_loses_no_acknowledged_one(tmp_path: Path) -> None:
    db = tmp_path / "responses.sqlite3"
    args = ("--responses-db", str(db), "-c", "2048", "--parallel", "4")
    with ServerProcess(*args) as server:
        writers = Writers(server.address).start()
        end = time.monotonic() + 150
        while len(writers.acknowledged) < MIN_ACKNOWLEDGED and time.monotonic() < end:
            time.sleep(0.05)
        server.kill()  # mid-write: four writers have requests in flight
        writers.join()
    acknowledged = dict(writers.acknowledged)
    assert len(acknowledged) >= MIN_ACKNOWLEDGED
    with sqlite3.connect(db) as raw:
        assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with ServerProcess(*args) as again, again.client() as http:
        lost = []
        for response_id, text in acknowledged.items():
            reply = http.get(f"/v1/responses/{response_id}")
            if reply.status_code != 200:
                lost.append(response_id)
                continue
            stored = reply.json()
            assert stored["status"] in ("completed", "incomplete") and output_text(stored) == text
        assert lost == []
        assert http.post("/v1/responses", json={"model": "m", "input": "Hi", "max_output_tokens": 2}).status_code == 200
    print(f"FIGURES kill9: sent={writers.num_sent} acknowledged={len(acknowledged)} lost={len(lost)} "
          f"restart_to_listening_s={again.startup_s:.1f}")


def _first_content(lines: Any, marker: str) -> None:
    next(line for line in lines if marker in line)


def test_sigterm_with_streams_in_flight_ends_each_cleanly_and_exits_0(tmp_path: Path) -> None:
    """Chat, Responses and Messages streams (and a named F6 stream whose client left) are running;
    SIGTERM: each client gets its protocol's terminal event, the process exits 0 well within the
    120 s worker deadline (A7)."""
    long = {"model": "m", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    chat = {**long, "messages": [{"role": "user", "content": "Hi"}]}
    server = ServerProcess("--responses-db", str(tmp_path / "r.sqlite3"), "-c", "8192", "--parallel", "4")
    with server, server.client() as http, server.client() as other, server.client() as third:
        with http.stream("POST", "/v1/chat/completions", json=chat, headers={"X-Conversation-Id": "left"}) as gone:
            _first_content(gone.iter_lines(), '"content":"')  # this client leaves; the stream keeps running
        with http.stream("POST", "/v1/chat/completions", json=chat) as a, \
                other.stream("POST", "/v1/responses", json={"model": "m", "input": "Hi", "stream": True,
                                                            "max_output_tokens": 2000, "ignore_eos": True}) as b, \
                third.stream("POST", "/v1/messages", json={**chat, "model": "claude-x"}) as c:
            lines = [r.iter_lines() for r in (a, b, c)]
            _first_content(lines[0], '"content":"')
            _first_content(lines[1], "response.output_text.delta")
            _first_content(lines[2], "content_block_delta")
            code, exit_s = server.terminate(timeout=120)
            chat_rest, responses_rest, messages_rest = (list(it) for it in lines)
    assert code == 0 and exit_s < 60
    assert sse_events(chat_rest)[-1]["choices"][0]["finish_reason"] == "abort" and "data: [DONE]" in chat_rest
    assert sse_events(responses_rest)[-1]["type"] == "response.failed"
    assert sse_events(messages_rest)[-1]["type"] == "message_stop"
    log = "".join(server.log)
    assert "SIGTERM received" in log and "shutdown complete" in log
    print(f"FIGURES sigterm: streams=4 clean_ends=3/3 exit_code={code} exit_s={exit_s:.1f}")
