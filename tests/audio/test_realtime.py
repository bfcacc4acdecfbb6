"""/v1/realtime through the real server with a real WebSocket client (spec H).

The cascade is the one `--realtime-stt/--realtime-tts` builds: the packaged Whisper and Piper
voice (session fixtures) around the real SmolLM2 chat engine. One whole voice turn is driven
with server VAD (speech in -> transcript -> answer text -> speech out); the limits use short
values so each closes within a second or two.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from mlxcel.api.modes import ModelEntry, SinglePurposeMode
from mlxcel.api.realtime import RealtimeLimits, RealtimeService
from mlxcel.api.realtime_cascade import CascadeEngine, resample
from mlxcel.serving.audio_models import AudioModels
from mlxcel.serving.served_model import ServedModel
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread
from mlxcel.server.state import ServerState
from mlxcel.serving.side_models import SideModels
from tests.audio.conftest import MAX_WER, word_error_rate
from tests.server.conftest import served  # noqa: F401 - the session's SmolLM2 engine

pytestmark = pytest.mark.slow

KEY = "realtime-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = RealtimeLimits(max_message_bytes=1 << 20, max_audio_s=30.0, session_update_timeout_s=30.0,
                        idle_timeout_s=30.0)


@pytest.fixture(scope="module")
def server(served: ServedModel, whisper: AudioModels, piper: AudioModels) -> Iterator[ServerThread]:  # noqa: F811
    mode = SinglePurposeMode("realtime", "--realtime-stt", "Connect to /v1/realtime.",
                             serves="a full-duplex voice session on the /v1/realtime WebSocket")
    side = SideModels(mode=mode, realtime=(whisper, piper), realtime_entry=ModelEntry("voice", ("realtime",), 0, 0))
    state = ServerState(ServerConfig(port=0, api_keys=(KEY,)), served, side=side)
    assert state.api is not None and whisper.transcriber is not None and piper.synthesizer is not None
    state.realtime = RealtimeService(CascadeEngine(whisper.transcriber, state.api, piper.synthesizer), "voice",
                                     limits=LIMITS)
    thread = ServerThread(state).start()
    yield thread
    thread.stop()


@pytest.fixture()
def service(server: ServerThread) -> Iterator[RealtimeService]:
    realtime = server.server.state.realtime  # type: ignore[attr-defined]
    yield realtime
    realtime.limits = LIMITS


def ws_url(server: ServerThread) -> str:
    return server.address.replace("http://", "ws://") + "/v1/realtime"


def pcm16_24k(path: Path, silence_s: float = 0.0) -> bytes:
    samples, rate = soundfile.read(path, dtype="float32")
    audio = np.concatenate([resample(samples, rate, 24_000), np.zeros(int(silence_s * 24_000), np.float32)])
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


async def events_until(ws: ClientConnection, last: str, timeout: float = 240.0) -> list[dict[str, Any]]:
    seen = []
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        seen.append(event)
        if event["type"] == last:
            return seen


async def close_of(ws: ClientConnection, timeout: float = 10.0) -> tuple[int, list[dict[str, Any]]]:
    events = []
    try:
        while True:
            events.append(json.loads(await asyncio.wait_for(ws.recv(), timeout)))
    except ConnectionClosed as closed:
        assert closed.rcvd is not None
        return closed.rcvd.code, events


def test_a_whole_voice_turn_with_server_vad(server: ServerThread, speak: Callable[[str], Path]) -> None:
    question = "What color is the sky on a clear day?"
    audio = pcm16_24k(speak(question), silence_s=1.0)

    async def turn() -> list[dict[str, Any]]:
        async with connect(ws_url(server), additional_headers=AUTH) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps({"type": "session.update", "session": {
                "instructions": "Answer in one short sentence.", "max_response_output_tokens": 24,
                "temperature": 0, "turn_detection": {"type": "server_vad", "silence_duration_ms": 500}}}))
            assert json.loads(await ws.recv())["type"] == "session.updated"
            step = 24_000 // 5 * 2  # 200 ms of pcm16 per append, as a microphone would send
            for start in range(0, len(audio), step):
                chunk = base64.b64encode(audio[start:start + step]).decode()
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
            return await events_until(ws, "response.done")

    events = asyncio.run(turn())
    kinds = [e["type"] for e in events]
    for expected in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                     "input_audio_buffer.committed", "response.created",
                     "conversation.item.input_audio_transcription.completed", "response.audio_transcript.delta",
                     "response.audio.delta", "response.audio.done", "response.audio_transcript.done"):
        assert expected in kinds, (expected, kinds)
    assert kinds.index("input_audio_buffer.speech_stopped") < kinds.index("response.created")
    heard = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert word_error_rate(question, heard["transcript"]) <= MAX_WER, heard["transcript"]
    answer = "".join(e["delta"] for e in events if e["type"] == "response.audio_transcript.delta")
    done = next(e for e in events if e["type"] == "response.audio_transcript.done")
    assert answer.strip() and done["transcript"] == answer
    pcm = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.audio.delta")
    assert len(pcm) / 2 / 24_000 > 0.5  # spoken, at 24 kHz pcm16
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["transcript"] == answer


def test_upgrade_needs_the_key_and_an_allowed_origin(server: ServerThread) -> None:
    async def status_of(**kwargs: Any) -> int:
        try:
            async with connect(ws_url(server), **kwargs) as ws:
                await ws.recv()
                return 101
        except InvalidStatus as exc:
            return exc.response.status_code

    assert asyncio.run(status_of()) == 401
    assert asyncio.run(status_of(additional_headers={"Authorization": "Bearer wrong"})) == 401
    assert asyncio.run(status_of(additional_headers=AUTH, origin="http://evil.example")) == 403
    assert asyncio.run(status_of(additional_headers=AUTH)) == 101  # no Origin: a non-browser client


def test_second_session_is_busy_with_1013(server: ServerThread) -> None:
    async def run() -> tuple[int, list[dict[str, Any]]]:
        async with connect(ws_url(server), additional_headers=AUTH) as first:
            await first.recv()
            async with connect(ws_url(server), additional_headers=AUTH) as second:
                return await close_of(second)

    code, events = asyncio.run(run())
    assert code == 1013 and events[0]["error"]["type"] == "server_busy"


@pytest.mark.parametrize("limits, send, reason", [
    (dataclasses.replace(LIMITS, session_update_timeout_s=0.5), [], "session_update_timeout"),
    (dataclasses.replace(LIMITS, idle_timeout_s=0.5), [{"type": "session.update", "session": {}}], "idle_timeout"),
    (dataclasses.replace(LIMITS, max_audio_s=0.5), [{"type": "input_audio_buffer.append",
                                                    "audio": base64.b64encode(bytes(48_000)).decode()}],
     "session_audio_limit"),
    (LIMITS, ["x" * ((1 << 20) + 1)], "message_too_large"),
])
def test_limits_close_the_session(server: ServerThread, service: RealtimeService, limits: RealtimeLimits,
                                  send: list[Any], reason: str) -> None:
    service.limits = limits

    async def run() -> tuple[int, list[dict[str, Any]]]:
        async with connect(ws_url(server), additional_headers=AUTH, max_size=None) as ws:
            await ws.recv()  # session.created
            for message in send:
                await ws.send(message if isinstance(message, str) else json.dumps(message))
            return await close_of(ws)

    code, events = asyncio.run(run())
    assert code == (1009 if reason == "message_too_large" else 1008)
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == reason


def test_bad_events_are_errors_not_disconnects(server: ServerThread) -> None:
    async def run() -> list[dict[str, Any]]:
        async with connect(ws_url(server), additional_headers=AUTH) as ws:
            await ws.recv()
            replies = []
            for message in ("not json", json.dumps({"type": "no.such.event"}),
                            json.dumps({"type": "input_audio_buffer.append", "audio": "%%%"}),
                            json.dumps({"type": "input_audio_buffer.commit"}),
                            json.dumps({"type": "session.update", "session": {"input_audio_format": "g711_ulaw"}})):
                await ws.send(message)
                replies.append(json.loads(await ws.recv()))
            await ws.send(json.dumps({"type": "session.update", "session": {"voice": "alloy"}}))
            replies.append(json.loads(await ws.recv()))
            return replies

    replies = asyncio.run(run())
    assert [r["error"]["code"] for r in replies[:5]] == ["invalid_json", "unknown_event", "invalid_audio",
                                                         "input_audio_buffer_commit_empty", "invalid_value"]
    assert replies[5]["type"] == "session.updated"


def test_chat_routes_point_to_realtime(server: ServerThread) -> None:
    response = httpx.post(f"{server.address}/v1/chat/completions", headers=AUTH,
                          json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 501 and "/v1/realtime" in response.json()["error"]["message"]
    models = httpx.get(f"{server.address}/v1/models", headers=AUTH).json()["data"]
    assert [(m["id"], m["capabilities"]) for m in models] == [("voice", ["realtime"])]
    providers = httpx.get(f"{server.address}/health").json()["providers"]
    assert [p["capability"] for p in providers] == ["transcription", "speech"]
