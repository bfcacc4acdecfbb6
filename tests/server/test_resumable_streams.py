"""F6 resumable streams through the real server and model: X-Conversation-Id, GET/DELETE /v1/stream,
POST /v1/streams/lookup. Clients really drop their connection (httpx, closing the socket mid-stream)
and resume with the number of events they received; the openai SDK starts the first stream.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from mlxcel.serving.served_model import ServedModel
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread

from .conftest import SERVER, chat_body, wait_until

pytestmark = pytest.mark.slow
HEADER = "X-Conversation-Id"


@pytest.fixture()
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.address, timeout=120) as client:
        yield client


def new_id() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def read_events(lines: Iterator[str], limit: int | None = None) -> list[str]:
    """Complete SSE events (their `data:` payloads) from a line iterator, at most `limit` of them."""
    events: list[str] = []
    data: list[str] = []
    for line in lines:
        if line.startswith(":"):
            continue
        if line == "":
            if data:
                events.append("\n".join(data))
                data = []
                if limit is not None and len(events) == limit:
                    break
            continue
        if line.startswith("data: "):
            data.append(line[6:])
    return events


def stream_events(http: httpx.Client, path: str, body: dict[str, object], cid: str | None,
                  limit: int | None = None) -> tuple[httpx.Headers, list[str]]:
    """POST a streamed request, read `limit` events (all when None) and close the connection."""
    headers = {HEADER: cid} if cid else {}
    with http.stream("POST", path, json=body, headers=headers) as reply:
        assert reply.status_code == 200, reply.read()
        return reply.headers, read_events(reply.iter_lines(), limit)


def replay(http: httpx.Client, cid: str, offset: int = 0) -> list[str]:
    with http.stream("GET", "/v1/stream", params={"conversation_id": cid, "offset": offset}) as reply:
        assert reply.status_code == 200, reply.read()
        assert reply.headers[HEADER] == cid
        return read_events(reply.iter_lines())


def lookup(http: httpx.Client, *cids: str) -> dict[str, object]:
    reply = http.post("/v1/streams/lookup", json={"conversation_ids": list(cids)})
    assert reply.status_code == 200, reply.text
    return reply.json()


def status_of(http: httpx.Client, cid: str) -> str | None:
    found = [s for s in lookup(http, cid)["data"] if s["conversation_id"] == cid]  # type: ignore[index]
    return found[0]["status"] if found else None


def requests_total(http: httpx.Client) -> float:
    text = http.get("/metrics").text
    return float(re.search(r"^mlxcel_requests_total (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]


def wait_idle(http: httpx.Client) -> None:
    wait_until(lambda: all(s["is_processing"] is False for s in http.get("/slots").json()), what="idle slots")


def chat_text(events: list[str]) -> str:
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_f6_openai_sdk_stream_carries_the_id_and_replays_identically(server: ServerThread,
                                                                     http: httpx.Client) -> None:
    cid = new_id()
    with openai.OpenAI(base_url=server.address + "/v1", api_key="x", max_retries=0, timeout=120) as sdk:
        raw = sdk.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0, stream=True,
            extra_headers={HEADER: cid})
        assert raw.headers[HEADER] == cid
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    events = replay(http, cid)
    assert events[-1] == "[DONE]" and chat_text(events) == text and text
    assert status_of(http, cid) == "completed"


def test_f6_an_id_is_assigned_when_the_client_sends_none(http: httpx.Client) -> None:
    headers, events = stream_events(http, "/v1/chat/completions", chat_body(stream=True, max_tokens=4), None)
    cid = headers[HEADER]
    assert cid.startswith("conv_") and replay(http, cid) == events


def test_f6_drop_mid_stream_then_resume_gets_every_event_once(http: httpx.Client) -> None:
    """The client drops after 3 events; the stream keeps generating, is counted once when it ends,
    and a resume from offset 3 gives exactly the rest: together the same text as an unbroken run."""
    # cache_prompt false: the streamed run would otherwise start from the first run's cached blocks,
    # and a cache hit's split prefill may differ in the last bits (spec M), so may its text.
    body = chat_body("Tell me a story", stream=True, max_tokens=40, cache_prompt=False)
    whole = http.post("/v1/chat/completions", json={**body, "stream": False}).json()
    wait_idle(http)
    before = requests_total(http)
    cid = new_id()
    _, head = stream_events(http, "/v1/chat/completions", body, cid, limit=3)
    assert len(head) == 3
    tail = replay(http, cid, offset=3)
    assert tail[-1] == "[DONE]"
    assert head + tail == replay(http, cid)
    assert chat_text(head + tail) == whole["choices"][0]["message"]["content"]
    wait_until(lambda: requests_total(http) == before + 1, what="the resumed stream counted once")
    wait_idle(http)


def test_f6_resume_while_generating_follows_live(http: httpx.Client) -> None:
    cid = new_id()
    body = chat_body("Count to twenty", stream=True, max_tokens=30)
    with http.stream("POST", "/v1/chat/completions", json=body, headers={HEADER: cid}) as first:
        lines = first.iter_lines()
        head = read_events(lines, limit=2)
        second = replay(http, cid, offset=1)  # another connection, while the first is still open
        rest = read_events(lines)
    assert head[1:] + rest == second and second[-1] == "[DONE]"


def test_f6_delete_cancels_a_running_stream_uncounted(http: httpx.Client) -> None:
    wait_idle(http)
    before = requests_total(http)
    cid = new_id()
    with http.stream("POST", "/v1/chat/completions", json=chat_body("Write a long essay", stream=True,
                                                                    max_tokens=400), headers={HEADER: cid}) as live:
        lines = live.iter_lines()
        assert len(read_events(lines, limit=2)) == 2
        deleted = http.delete("/v1/stream", params={"conversation_id": cid})
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        rest = read_events(lines)  # the live connection ends without [DONE]
    assert "[DONE]" not in rest and len(rest) < 300
    assert lookup(http, cid)["not_found"] == [cid]
    assert http.get("/v1/stream", params={"conversation_id": cid}).status_code == 404
    wait_idle(http)
    assert requests_total(http) == before


def test_f6_same_id_replaces_the_running_session(http: httpx.Client) -> None:
    wait_idle(http)
    before = requests_total(http)
    cid = new_id()
    with http.stream("POST", "/v1/chat/completions", json=chat_body("Write a long essay", stream=True,
                                                                    max_tokens=400), headers={HEADER: cid}) as old:
        lines = old.iter_lines()
        read_events(lines, limit=2)
        _, new_events = stream_events(http, "/v1/chat/completions", chat_body(stream=True, max_tokens=4), cid)
        old_rest = read_events(lines)
    assert new_events[-1] == "[DONE]" and "[DONE]" not in old_rest
    assert replay(http, cid) == new_events
    wait_idle(http)
    assert requests_total(http) == before + 1  # the replaced stream is not counted


def test_f6_an_assigned_id_stream_is_cancelled_with_its_connection(http: httpx.Client) -> None:
    wait_idle(http)
    before = requests_total(http)
    headers, _ = stream_events(http, "/v1/chat/completions", chat_body("Write a long essay", stream=True,
                                                                       max_tokens=400), None, limit=2)
    cid = headers[HEADER]
    wait_until(lambda: status_of(http, cid) == "cancelled", what="the stream cancelled")
    wait_idle(http)
    assert requests_total(http) == before


def test_f6_responses_stream_drop_and_resume(http: httpx.Client) -> None:
    cid = new_id()
    body = {"model": "m", "input": "Hi", "max_output_tokens": 12, "temperature": 0, "stream": True}
    _, head = stream_events(http, "/v1/responses", body, cid, limit=2)
    tail = replay(http, cid, offset=2)
    events = [json.loads(e) for e in head + tail]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))  # no gap, no repeat


def test_f6_errors_are_json_envelopes(http: httpx.Client) -> None:
    assert http.get("/v1/stream", params={"conversation_id": "nope"}).status_code == 404
    assert http.get("/v1/stream").status_code == 400
    assert http.delete("/v1/stream", params={"conversation_id": "nope"}).json()["error"]["code"] == 404
    cid = new_id()
    _, events = stream_events(http, "/v1/chat/completions", chat_body(stream=True, max_tokens=3), cid)
    for offset in ("-1", "x", "1e3"):
        assert http.get("/v1/stream", params={"conversation_id": cid, "offset": offset}).status_code == 400
    past = http.get("/v1/stream", params={"conversation_id": cid, "offset": len(events) + 1})
    assert past.status_code == 400 and "past the end" in past.json()["error"]["message"]
    assert replay(http, cid, offset=len(events)) == []
    bad = http.post("/v1/chat/completions", json=chat_body(stream=True), headers={HEADER: "has space"})
    assert bad.status_code == 400 and "X-Conversation-Id" in bad.json()["error"]["message"]
    for body in ({}, {"conversation_ids": "a"}, {"conversation_ids": [1]}, {"conversation_ids": ["a"] * 300}):
        reply = http.post("/v1/streams/lookup", json=body)
        assert reply.status_code == 400 and "error" in reply.json()


def test_f6_buffer_limits_drop_old_events_and_expire(served: ServedModel,
                                                     start_server: Callable[..., ServerThread]) -> None:
    config = ServerConfig(port=0, stream_buffer_bytes=600, stream_buffer_ttl_s=1.0, stream_buffer_streams=2)
    small = start_server(served, config)
    with httpx.Client(base_url=small.address, timeout=120) as http:
        cid = new_id()
        _, events = stream_events(http, "/v1/chat/completions", chat_body(stream=True, max_tokens=20), cid)
        kept = lookup(http, cid)["data"][0]  # type: ignore[index]
        assert kept["bytes"] <= 600 and kept["first_offset"] > 0 and kept["num_events"] == len(events)
        gone = http.get("/v1/stream", params={"conversation_id": cid, "offset": 0})
        assert gone.status_code == 410
        assert replay(http, cid, offset=kept["first_offset"]) == events[kept["first_offset"]:]
        others = [new_id() for _ in range(3)]
        for other in others:
            stream_events(http, "/v1/chat/completions", chat_body(stream=True, max_tokens=2), other)
        assert len(lookup(http, cid, *others)["data"]) <= 2  # at most 2 kept (fewer once the 1 s TTL passed)
        time.sleep(3.0)
        assert len(lookup(http, *others)["data"]) == 0  # expired
    assert SERVER.stream_buffer_ttl_s == 300.0
