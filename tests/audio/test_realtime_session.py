"""The realtime session's protocol over a scripted engine (spec H): no model, exact event order."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from mlxcel.api.realtime import (
    AudioDelta, EngineEvent, InputTranscript, RealtimeLimits, RealtimeSession, TextDelta, Turn,
)


class ScriptedEngine:
    """Hears "hello"; answers "Hi. Bye." with one audio chunk per sentence, `pause` s apart."""

    def __init__(self, pause: float = 0.0) -> None:
        self.pause = pause
        self.turns: list[Turn] = []

    def detect_turn_end(self, audio: np.ndarray, silence_ms: int, threshold: float) -> tuple[bool, bool]:
        loud = np.flatnonzero(np.abs(audio) > 0.1)
        if loud.size == 0:
            return False, False
        return True, (audio.size - loud[-1]) / 24_000 * 1000 >= silence_ms

    async def respond(self, turn: Turn) -> AsyncIterator[EngineEvent]:
        self.turns.append(turn)
        if turn.audio is not None:
            yield InputTranscript("hello")
        for sentence in ("Hi.", " Bye."):
            await asyncio.sleep(self.pause)
            yield TextDelta(sentence)
            yield AudioDelta(bytes(480))


def pcm(seconds: float, level: float) -> str:
    return base64.b64encode((np.full(int(seconds * 24_000), level) * 32767).astype("<i2").tobytes()).decode()


async def drive(engine: ScriptedEngine, client: list[dict[str, Any]], wait_for: str, count: int = 1,
                ) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    inbox: asyncio.Queue[str | None] = asyncio.Queue()

    async def send(event: dict[str, Any]) -> None:
        sent.append(event)

    session = RealtimeSession(engine, RealtimeLimits(), "m", send)
    task = asyncio.create_task(session.run(inbox.get))
    for event in client:
        await inbox.put(json.dumps(event))
        await asyncio.sleep(0.01)
    while sum(e["type"] == wait_for for e in sent) < count:
        await asyncio.sleep(0.01)
    await inbox.put(None)
    assert await task == (1000, "client closed")
    return sent


def test_manual_turn_event_order() -> None:
    engine = ScriptedEngine()
    events = asyncio.run(drive(engine, [
        {"type": "session.update", "session": {"instructions": "Be brief.", "max_response_output_tokens": 9}},
        {"type": "input_audio_buffer.append", "audio": pcm(0.5, 0.5)},
        {"type": "input_audio_buffer.commit"},
        {"type": "response.create"}], "response.done"))
    kinds = [e["type"] for e in events]
    assert kinds == ["session.created", "session.updated", "input_audio_buffer.committed",
                     "conversation.item.created", "response.created", "response.output_item.added",
                     "conversation.item.input_audio_transcription.completed",
                     "response.audio_transcript.delta", "response.audio.delta",
                     "response.audio_transcript.delta", "response.audio.delta",
                     "response.audio.done", "response.audio_transcript.done", "response.output_item.done",
                     "response.done"]
    turn = engine.turns[0]
    assert turn.instructions == "Be brief." and turn.max_output_tokens == 9 and turn.audio.size == 12_000
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["output"][0]["content"][0]["transcript"] == "Hi. Bye."


def test_server_vad_commits_and_answers_then_remembers() -> None:
    engine = ScriptedEngine()
    vad = {"type": "server_vad", "silence_duration_ms": 300}
    events = asyncio.run(drive(engine, [
        {"type": "session.update", "session": {"turn_detection": vad}},
        {"type": "input_audio_buffer.append", "audio": pcm(0.4, 0.5)},
        {"type": "input_audio_buffer.append", "audio": pcm(0.4, 0.0)},
        {"type": "input_audio_buffer.append", "audio": pcm(0.4, 0.5)},
        {"type": "input_audio_buffer.append", "audio": pcm(0.4, 0.0)}], "response.done", count=2))
    kinds = [e["type"] for e in events]
    assert kinds.count("input_audio_buffer.speech_started") == 2 and kinds.count("input_audio_buffer.committed") == 2
    assert engine.turns[1].history == ({"role": "user", "content": "hello"},
                                       {"role": "assistant", "content": "Hi. Bye."})


def test_barge_in_and_response_cancel() -> None:
    engine = ScriptedEngine(pause=0.5)
    vad = {"type": "server_vad", "silence_duration_ms": 300}
    events = asyncio.run(drive(engine, [
        {"type": "session.update", "session": {"turn_detection": vad}},
        {"type": "input_audio_buffer.append", "audio": pcm(0.4, 0.5)},
        {"type": "input_audio_buffer.append", "audio": pcm(0.4, 0.0)},  # turn ends: the answer starts
        {"type": "input_audio_buffer.append", "audio": pcm(0.2, 0.5)},  # the user talks over it
    ], "response.done"))
    done = next(e for e in events if e["type"] == "response.done")
    assert done["response"]["status"] == "cancelled"
    assert [e["type"] for e in events].index("response.created") < [e["type"] for e in events].index(
        "response.done")
    events = asyncio.run(drive(ScriptedEngine(pause=0.5), [
        {"type": "session.update", "session": {}}, {"type": "response.create"}, {"type": "response.create"},
        {"type": "response.cancel"}], "response.done"))
    assert any(e.get("error", {}).get("code") == "conversation_already_has_active_response" for e in events)
    assert next(e for e in events if e["type"] == "response.done")["response"]["status"] == "cancelled"
