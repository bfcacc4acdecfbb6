"""The `/v1/realtime` voice session (spec H) in the OpenAI Realtime event vocabulary.

Framework-neutral: the server hands in `receive` (the next text message, or None when the
client left) and `send`, and closes the socket with what `run` returns. The session keeps
the input audio buffer (pcm16, 24 kHz, base64 in `input_audio_buffer.append`), the
conversation, and turns each committed buffer into one response through a `RealtimeEngine`.
The source's engine is one speech-to-speech model (Nemotron VoiceChat); the engine served
here is a cascade (`api.realtime_cascade`): voice activity detection, Whisper, the chat
model streamed, then speech. Another engine (a speech-to-speech model) plugs in behind the
same protocol without touching this module.

Limits (the source's): 1 MiB per message (close 1009), 600 s of input audio per session,
30 s from connecting to the first `session.update`, 120 s without a client message (idle).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

log = logging.getLogger(__name__)

SAMPLE_RATE = 24_000  # OpenAI Realtime's pcm16: 24 kHz mono little-endian
CLOSE_NORMAL, CLOSE_POLICY, CLOSE_TOO_BIG, CLOSE_TRY_AGAIN = 1000, 1008, 1009, 1013


@dataclass(frozen=True, slots=True)
class RealtimeLimits:
    max_message_bytes: int = 1 << 20
    max_audio_s: float = 600.0
    session_update_timeout_s: float = 30.0
    idle_timeout_s: float = 120.0


@dataclass(frozen=True, slots=True)
class InputTranscript:
    text: str


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class AudioDelta:
    pcm16: bytes  # 24 kHz mono


EngineEvent = InputTranscript | TextDelta | AudioDelta


@dataclass(frozen=True, slots=True)
class Turn:
    audio: np.ndarray | None  # [num_samples] float32 at 24 kHz: the committed user audio, if any
    history: tuple[dict[str, str], ...]  # earlier messages, chat-template shaped
    instructions: str | None
    voice: str
    max_output_tokens: int | None
    temperature: float


class RealtimeEngine(Protocol):
    """What a session drives. A cascade and a speech-to-speech model both fit."""

    def respond(self, turn: Turn) -> AsyncIterator[EngineEvent]: ...

    def detect_turn_end(self, audio: np.ndarray, silence_ms: int, threshold: float) -> tuple[bool, bool]:
        """(speech started, speech ended with `silence_ms` of silence after it) for 24 kHz audio."""
        ...


class RealtimeGate:
    """One session at a time (the source's engine takes one); a second gets server_busy + 1013."""

    def __init__(self) -> None:
        self._is_taken = False

    def try_take(self) -> bool:
        if self._is_taken:
            return False
        self._is_taken = True
        return True

    def release(self) -> None:
        self._is_taken = False


@dataclass
class RealtimeService:
    """What a realtime process serves on /v1/realtime: the engine, the model name and the limits,
    behind its one-session gate (server/realtime.py mounts it)."""

    engine: RealtimeEngine
    model: str
    limits: RealtimeLimits = RealtimeLimits()
    gate: RealtimeGate = field(default_factory=RealtimeGate)


def error_event(kind: str, code: str, message: str, event_id: str | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"type": kind, "code": code, "message": message}
    if event_id is not None:
        error["event_id"] = event_id
    return {"type": "error", "event_id": _id("event"), "error": error}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class SessionClosed(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


Receive = Callable[[], Awaitable[str | bytes | None]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class RealtimeSession:
    engine: RealtimeEngine
    limits: RealtimeLimits
    model: str
    send: Send
    session_id: str = field(default_factory=lambda: _id("sess"))
    config: dict[str, Any] = field(default_factory=dict)
    buffer: list[np.ndarray] = field(default_factory=list)
    history: list[dict[str, str]] = field(default_factory=list)
    num_audio_samples: int = 0
    is_configured: bool = False
    is_speaking: bool = False
    pending_audio: tuple[str, np.ndarray] | None = None  # the committed user turn, until a response takes it
    response_task: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        self.config = {"id": self.session_id, "object": "realtime.session", "model": self.model,
                       "modalities": ["text", "audio"], "instructions": "", "voice": "alloy",
                       "input_audio_format": "pcm16", "output_audio_format": "pcm16",
                       "input_audio_transcription": None, "turn_detection": None, "temperature": 0.8,
                       "max_response_output_tokens": "inf"}

    async def run(self, receive: Receive) -> tuple[int, str]:
        """Serve until the client leaves or a limit closes the session; returns (close code, reason)."""
        await self.send({"type": "session.created", "event_id": _id("event"), "session": self.config})
        try:
            while True:
                message = await self._next_message(receive)
                if message is None:
                    return CLOSE_NORMAL, "client closed"
                await self._handle(message)
        except SessionClosed as closed:
            return closed.code, closed.reason
        finally:
            await self._cancel_response()

    async def _next_message(self, receive: Receive) -> str | bytes | None:
        if self.is_configured:
            timeout, what = self.limits.idle_timeout_s, "idle_timeout"
            message = f"no client message for {self.limits.idle_timeout_s:g} s; closing the idle session"
        else:
            timeout, what = self.limits.session_update_timeout_s, "session_update_timeout"
            message = f"no session.update within {self.limits.session_update_timeout_s:g} s of connecting"
        try:
            return await asyncio.wait_for(receive(), timeout)
        except TimeoutError:
            await self.send(error_event("invalid_request_error", what, message))
            raise SessionClosed(CLOSE_POLICY, what) from None

    async def _handle(self, raw: str | bytes) -> None:
        if len(raw) > self.limits.max_message_bytes:
            await self.send(error_event("invalid_request_error", "message_too_large",
                                        f"a message of {len(raw)} bytes is over the {self.limits.max_message_bytes}"
                                        "-byte limit"))
            raise SessionClosed(CLOSE_TOO_BIG, "message too large")
        try:
            event = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            await self.send(error_event("invalid_request_error", "invalid_json", f"not a JSON event: {exc}"))
            return
        kind = event.get("type") if isinstance(event, dict) else None
        handler = _HANDLERS.get(kind) if isinstance(kind, str) else None
        if handler is None:
            await self.send(error_event("invalid_request_error", "unknown_event",
                                        f"unknown event type {kind!r}", event_id=_event_id(event)))
            return
        await handler(self, event)

    # ---- client events ----

    async def session_update(self, event: dict[str, Any]) -> None:
        update = event.get("session")
        if not isinstance(update, dict):
            await self.send(error_event("invalid_request_error", "invalid_value", "session.update needs a "
                                        "'session' object", event_id=_event_id(event)))
            return
        problem = _check_session(update)
        if problem is not None:
            await self.send(error_event("invalid_request_error", "invalid_value", problem, event_id=_event_id(event)))
            return
        self.config.update({k: v for k, v in update.items() if k in self.config and k not in ("id", "object")})
        self.is_configured = True
        await self.send({"type": "session.updated", "event_id": _id("event"), "session": self.config})

    async def audio_append(self, event: dict[str, Any]) -> None:
        samples = _pcm16_samples(event.get("audio"))
        if samples is None:
            await self.send(error_event("invalid_request_error", "invalid_audio", "input_audio_buffer.append needs "
                                        "'audio': base64 of 16-bit little-endian 24 kHz mono PCM",
                                        event_id=_event_id(event)))
            return
        self.num_audio_samples += samples.size
        if self.num_audio_samples > self.limits.max_audio_s * SAMPLE_RATE:
            await self.send(error_event("invalid_request_error", "session_audio_limit",
                                        f"this session sent more than {self.limits.max_audio_s:g} s of audio"))
            raise SessionClosed(CLOSE_POLICY, "session audio limit")
        self.buffer.append(samples)
        if isinstance(self.config.get("turn_detection"), dict):
            await self._detect_turn()

    async def _detect_turn(self) -> None:
        detection = self.config["turn_detection"]
        audio = np.concatenate(self.buffer)
        started, ended = await asyncio.to_thread(self.engine.detect_turn_end, audio,
                                                 int(detection.get("silence_duration_ms", 500)),
                                                 float(detection.get("threshold", 0.5)))
        if started and not self.is_speaking:
            self.is_speaking = True
            await self.send({"type": "input_audio_buffer.speech_started", "event_id": _id("event"),
                             "audio_start_ms": 0, "item_id": None})
            if detection.get("interrupt_response", True):
                await self._cancel_response()  # barge-in: the user talks over the answer
        if self.is_speaking and ended:
            self.is_speaking = False
            await self.send({"type": "input_audio_buffer.speech_stopped", "event_id": _id("event"),
                             "audio_end_ms": int(1000 * audio.size / SAMPLE_RATE), "item_id": None})
            await self.audio_commit({})
            if detection.get("create_response", True):
                await self.response_create({})

    async def audio_clear(self, event: dict[str, Any]) -> None:
        self.buffer.clear()
        await self.send({"type": "input_audio_buffer.cleared", "event_id": _id("event")})

    async def audio_commit(self, event: dict[str, Any]) -> None:
        if not self.buffer:
            await self.send(error_event("invalid_request_error", "input_audio_buffer_commit_empty",
                                        "the input audio buffer is empty", event_id=_event_id(event)))
            return
        item_id = _id("item")
        self.pending_audio = (item_id, np.concatenate(self.buffer))
        self.buffer.clear()
        await self.send({"type": "input_audio_buffer.committed", "event_id": _id("event"),
                         "previous_item_id": None, "item_id": item_id})
        await self.send({"type": "conversation.item.created", "event_id": _id("event"), "previous_item_id": None,
                         "item": {"id": item_id, "object": "realtime.item", "type": "message", "role": "user",
                                  "status": "completed", "content": [{"type": "input_audio", "transcript": None}]}})

    async def response_create(self, event: dict[str, Any]) -> None:
        if self.response_task is not None and not self.response_task.done():
            await self.send(error_event("invalid_request_error", "conversation_already_has_active_response",
                                        "a response is already in progress", event_id=_event_id(event)))
            return
        pending, self.pending_audio = self.pending_audio, None
        self.response_task = asyncio.create_task(self._respond(pending))

    async def response_cancel(self, event: dict[str, Any]) -> None:
        await self._cancel_response()

    async def _cancel_response(self) -> None:
        task = self.response_task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ---- one response ----

    async def _respond(self, pending: tuple[str, np.ndarray] | None) -> None:
        response_id, item_id = _id("resp"), _id("item")
        response: dict[str, Any] = {"id": response_id, "object": "realtime.response", "status": "in_progress",
                                    "output": [], "usage": None}
        await self.send({"type": "response.created", "event_id": _id("event"), "response": response})
        item = {"id": item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": "in_progress", "content": []}
        await self.send({"type": "response.output_item.added", "event_id": _id("event"), "response_id": response_id,
                         "output_index": 0, "item": item})
        ids = {"response_id": response_id, "item_id": item_id, "output_index": 0, "content_index": 0}
        transcript: list[str] = []
        status = "completed"
        try:
            await self._stream_turn(pending, ids, transcript)
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        except Exception as exc:  # noqa: BLE001 - the engine's failure ends this response, not the session
            log.exception("realtime response failed")
            status = "failed"
            await self.send(error_event("server_error", "response_failed", f"the response failed: {exc}"))
        finally:
            text = "".join(transcript)
            if status == "completed":
                self.history.append({"role": "assistant", "content": text})
            item.update(status="completed" if status == "completed" else "incomplete",
                        content=[{"type": "audio", "transcript": text}])
            response.update(status=status, output=[item])
            with contextlib.suppress(Exception):
                await self._finish(ids, text, item, response)

    async def _stream_turn(self, pending: tuple[str, np.ndarray] | None, ids: dict[str, Any],
                           transcript: list[str]) -> None:
        limit = self.config.get("max_response_output_tokens")
        turn = Turn(pending[1] if pending else None, tuple(self.history), self.config.get("instructions") or None,
                    str(self.config.get("voice") or "alloy"), limit if isinstance(limit, int) else None,
                    float(self.config.get("temperature", 0.8)))
        async for event in self.engine.respond(turn):
            if isinstance(event, InputTranscript):
                self.history.append({"role": "user", "content": event.text})
                await self.send({"type": "conversation.item.input_audio_transcription.completed",
                                 "event_id": _id("event"), "item_id": pending[0] if pending else None,
                                 "content_index": 0, "transcript": event.text})
            elif isinstance(event, TextDelta):
                transcript.append(event.text)
                await self.send({"type": "response.audio_transcript.delta", "event_id": _id("event"), **ids,
                                 "delta": event.text})
            else:
                await self.send({"type": "response.audio.delta", "event_id": _id("event"), **ids,
                                 "delta": base64.b64encode(event.pcm16).decode("ascii")})

    async def _finish(self, ids: dict[str, Any], text: str, item: dict[str, Any], response: dict[str, Any]) -> None:
        await self.send({"type": "response.audio.done", "event_id": _id("event"), **ids})
        await self.send({"type": "response.audio_transcript.done", "event_id": _id("event"), **ids,
                         "transcript": text})
        await self.send({"type": "response.output_item.done", "event_id": _id("event"),
                         "response_id": ids["response_id"], "output_index": 0, "item": item})
        await self.send({"type": "response.done", "event_id": _id("event"), "response": response})


def _event_id(event: object) -> str | None:
    value = event.get("event_id") if isinstance(event, dict) else None
    return value if isinstance(value, str) else None


def _check_session(update: dict[str, Any]) -> str | None:
    for name in ("input_audio_format", "output_audio_format"):
        if name in update and update[name] != "pcm16":
            return f"{name}: only 'pcm16' (16-bit, 24 kHz mono) is served"
    detection = update.get("turn_detection")
    if detection is not None and (not isinstance(detection, dict) or detection.get("type") != "server_vad"):
        return "turn_detection: null (commit yourself) or {\"type\": \"server_vad\", ...}"
    limit = update.get("max_response_output_tokens")
    if limit is not None and limit != "inf" and not (isinstance(limit, int) and 1 <= limit <= 4096):
        return "max_response_output_tokens: an integer from 1 to 4096, or 'inf'"
    temperature = update.get("temperature")
    if temperature is not None and not (isinstance(temperature, (int, float)) and 0 <= temperature <= 2):
        return "temperature: a number from 0 to 2"
    return None


def _pcm16_samples(audio: object) -> np.ndarray | None:
    if not isinstance(audio, str):
        return None
    try:
        data = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(data) % 2:
        return None
    return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0


_HANDLERS: dict[str, Callable[[RealtimeSession, dict[str, Any]], Awaitable[None]]] = {
    "session.update": RealtimeSession.session_update,
    "input_audio_buffer.append": RealtimeSession.audio_append,
    "input_audio_buffer.commit": RealtimeSession.audio_commit,
    "input_audio_buffer.clear": RealtimeSession.audio_clear,
    "response.create": RealtimeSession.response_create,
    "response.cancel": RealtimeSession.response_cancel,
}
