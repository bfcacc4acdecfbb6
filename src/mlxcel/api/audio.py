"""OpenAI's audio API (spec G): transcriptions, translations and speech, protocol side only.

The server hands in the multipart fields as plain values and the upload as an `AudioUpload`;
this module validates them (400 naming the field), decodes the audio (400 for anything that is
not decodable audio, naming what was wrong), runs the provider (503 full, 504 past the deadline)
and formats the answer: json, text, srt, vtt or verbose_json for transcripts; wav, mp3, flac or
pcm for speech, the streamable formats sent sentence by sentence as the voice produces them.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlxcel.api.errors import ApiError, invalid_request
from mlxcel.api.providers import from_worker_error, next_from_worker
from mlxcel.api.replies import ByteStreamReply, BytesReply, JsonReply, Reply
from mlxcel.workers.audio_io import (
    MEDIA_TYPES, SPEECH_FORMATS, STREAMED_FORMATS, AudioInputError, decode_audio, encode_audio,
    streaming_wav_header, to_int16,
)
from mlxcel.workers.base import WorkerError
from mlxcel.workers.speech import SpeechJob, SpeechSynthesizer
from mlxcel.workers.whisper import Task, TranscriptionJob, Transcript, WhisperTranscriber

log = logging.getLogger(__name__)

TRANSCRIPT_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
MAX_SPEECH_INPUT_CHARS = 4096  # OpenAI's limit for /v1/audio/speech
_TRANSCRIBE_FIELDS = {"file", "model", "language", "prompt", "response_format", "temperature",
                      "timestamp_granularities[]", "timestamp_granularities", "stream"}
_TRANSLATE_FIELDS = {"file", "model", "prompt", "response_format", "temperature"}
_LANGUAGE_NAMES = {"en": "english"}


@dataclass(frozen=True, slots=True)
class AudioUpload:
    filename: str
    content_type: str | None
    data: bytes


@dataclass(frozen=True, slots=True)
class AudioLimits:
    max_upload_bytes: int = 25 << 20  # OpenAI's 25 MB
    max_duration_s: float = 600.0


@dataclass(frozen=True, slots=True)
class TranscriptionRequest:
    task: Task
    response_format: str
    language: str | None
    prompt: str | None
    temperature: float | None
    granularities: tuple[str, ...]


# ---- transcriptions and translations ----

def parse_transcription_form(fields: Mapping[str, Sequence[str]], task: Task) -> TranscriptionRequest:
    """The form's text fields, validated; raises a 400 ApiError naming the field."""
    allowed = _TRANSCRIBE_FIELDS if task == "transcribe" else _TRANSLATE_FIELDS
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise invalid_request(f"unknown field {unknown[0]!r}; this route takes {', '.join(sorted(allowed))}")
    response_format = _one(fields, "response_format") or "json"
    if response_format not in TRANSCRIPT_FORMATS:
        raise invalid_request(f"response_format must be one of {', '.join(TRANSCRIPT_FORMATS)}, not "
                              f"{response_format!r}")
    if _one(fields, "stream") not in (None, "false", "False", "0"):
        raise invalid_request("stream: streamed transcription is not available for Whisper models; omit it")
    granularities = tuple(fields.get("timestamp_granularities[]", ())) + tuple(
        fields.get("timestamp_granularities", ()))
    if any(g not in ("word", "segment") for g in granularities):
        raise invalid_request("timestamp_granularities[] takes 'word' and/or 'segment'")
    if granularities and response_format != "verbose_json":
        raise invalid_request("timestamp_granularities[] needs response_format verbose_json")
    return TranscriptionRequest(task, response_format, _language(fields), _one(fields, "prompt"),
                                _temperature(fields), granularities or ("segment",))


def _one(fields: Mapping[str, Sequence[str]], name: str) -> str | None:
    values = fields.get(name) or ()
    if len(values) > 1:
        raise invalid_request(f"{name}: give it once, not {len(values)} times")
    return values[0] if values else None


def _language(fields: Mapping[str, Sequence[str]]) -> str | None:
    language = _one(fields, "language")
    if language is None or language == "":
        return None
    if not language.isalpha() or len(language) > 3:
        raise invalid_request(f"language must be an ISO-639-1 code such as 'en', not {language!r}")
    return language.lower()


def _temperature(fields: Mapping[str, Sequence[str]]) -> float | None:
    text = _one(fields, "temperature")
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        raise invalid_request(f"temperature must be a number between 0 and 1, not {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise invalid_request(f"temperature must be between 0 and 1, not {value:g}")
    return value


def check_upload(upload: AudioUpload | None, limits: AudioLimits) -> AudioUpload:
    if upload is None:
        raise invalid_request("file: upload the audio as the multipart field 'file'")
    if len(upload.data) > limits.max_upload_bytes:
        raise invalid_request(f"file: {upload.filename} is {len(upload.data)} bytes, over this server's "
                              f"{limits.max_upload_bytes}-byte limit (--audio-max-upload-size)", status=413)
    return upload


async def transcribe(transcriber: WhisperTranscriber, request: TranscriptionRequest, upload: AudioUpload,
                     limits: AudioLimits) -> Reply:
    """POST /v1/audio/transcriptions and /v1/audio/translations."""
    _check_language(transcriber, request)
    samples = await _decode(upload, limits)
    job = TranscriptionJob(samples, request.task, request.language, request.prompt, request.temperature,
                           word_timestamps="word" in request.granularities)
    try:
        transcript = await transcriber.transcribe(job)
    except WorkerError as exc:
        raise from_worker_error(exc) from None
    return format_transcript(transcript, request)


def _check_language(transcriber: WhisperTranscriber, request: TranscriptionRequest) -> None:
    if request.language is None:
        return
    if not transcriber.is_multilingual and request.language != "en":
        raise invalid_request(f"language {request.language!r}: this Whisper model is English-only; send English "
                              "audio with language 'en' (or none), or serve a multilingual checkpoint")
    if transcriber.is_multilingual and request.language not in transcriber.languages:
        raise invalid_request(f"language {request.language!r} is not one this Whisper model knows")


async def _decode(upload: AudioUpload, limits: AudioLimits) -> np.ndarray:
    # FFmpeg decoding takes real CPU time; keep it off the event loop.
    try:
        decoded = await asyncio.to_thread(decode_audio, upload.data, max_duration_s=limits.max_duration_s,
                                          filename=upload.filename)
    except AudioInputError as exc:
        raise invalid_request(str(exc)) from None
    return decoded.samples


def format_transcript(transcript: Transcript, request: TranscriptionRequest) -> Reply:
    fmt = request.response_format
    if fmt == "text":
        return BytesReply(f"{transcript.text}\n".encode(), "text/plain; charset=utf-8")
    if fmt == "srt":
        return BytesReply(to_srt(transcript).encode(), "text/plain; charset=utf-8")
    if fmt == "vtt":
        return BytesReply(to_vtt(transcript).encode(), "text/vtt; charset=utf-8")
    usage = {"type": "duration", "seconds": math.ceil(transcript.duration_s)}
    if fmt == "json":
        return JsonReply({"text": transcript.text, "usage": usage})
    return JsonReply(verbose_json(transcript, request.granularities) | {"usage": usage})


def verbose_json(transcript: Transcript, granularities: Sequence[str]) -> dict[str, Any]:
    body: dict[str, Any] = {"task": transcript.task, "language": _LANGUAGE_NAMES.get(transcript.language,
                                                                                     transcript.language),
                            "duration": round(transcript.duration_s, 3), "text": transcript.text}
    if "segment" in granularities:
        body["segments"] = [
            {"id": s.id, "seek": s.seek, "start": round(s.start, 3), "end": round(s.end, 3), "text": s.text,
             "tokens": list(s.tokens), "temperature": s.temperature, "avg_logprob": s.avg_logprob,
             "compression_ratio": s.compression_ratio, "no_speech_prob": s.no_speech_prob}
            for s in transcript.segments]
    if "word" in granularities:
        body["words"] = [{"word": w.word.strip(), "start": round(w.start, 3), "end": round(w.end, 3)}
                         for w in transcript.words]
    return body


def _timestamp(seconds: float, separator: str) -> str:
    millis = int(round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def to_srt(transcript: Transcript) -> str:
    blocks = [f"{index}\n{_timestamp(s.start, ',')} --> {_timestamp(s.end, ',')}\n{s.text.strip()}\n"
              for index, s in enumerate(transcript.segments, start=1)]
    return "\n".join(blocks)


def to_vtt(transcript: Transcript) -> str:
    blocks = [f"{_timestamp(s.start, '.')} --> {_timestamp(s.end, '.')}\n{s.text.strip()}\n"
              for s in transcript.segments]
    return "WEBVTT\n\n" + "\n".join(blocks)


# ---- speech ----

@dataclass(frozen=True, slots=True)
class SpeechRequest:
    text: str
    voice: str
    response_format: str
    speed: float
    stream_format: str  # "audio" (OpenAI's default) or "sse" (refused)


def parse_speech_request(body: Mapping[str, Any], synthesizer: SpeechSynthesizer) -> SpeechRequest:
    """The JSON body of POST /v1/audio/speech, validated against the loaded voice; 400 naming the field."""
    if not isinstance(body, Mapping):
        raise invalid_request("the body must be a JSON object with input, voice and model")
    allowed = {"model", "input", "voice", "response_format", "speed", "instructions", "stream_format"}
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid_request(f"unknown field {unknown[0]!r}; this route takes {', '.join(sorted(allowed))}")
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        raise invalid_request("input: the text to speak is required (a non-empty string)")
    if len(text) > MAX_SPEECH_INPUT_CHARS:
        raise invalid_request(f"input: {len(text)} characters, over the limit of {MAX_SPEECH_INPUT_CHARS}")
    voice = _speech_voice(body.get("voice"), synthesizer)
    response_format = body.get("response_format", "mp3")
    if response_format not in SPEECH_FORMATS:
        raise invalid_request(f"response_format must be one of {', '.join(SPEECH_FORMATS)} here, not "
                              f"{response_format!r}")
    stream_format = body.get("stream_format", "audio")
    if stream_format != "audio":
        raise invalid_request("stream_format: only 'audio' is served (the audio bytes, streamed for wav and pcm)")
    return SpeechRequest(text, voice, response_format, _speed(body.get("speed", 1.0), synthesizer), stream_format)


def _speech_voice(voice: object, synthesizer: SpeechSynthesizer) -> str:
    if isinstance(voice, dict) and isinstance(voice.get("id"), str):
        voice = voice["id"]
    if not isinstance(voice, str) or not voice:
        raise invalid_request(f"voice is required; this model's voices: {', '.join(synthesizer.voice.voices)}")
    resolved = synthesizer.resolve_voice(voice)
    if resolved is None:
        raise invalid_request(f"voice {voice!r} is not one of this model's voices "
                              f"({', '.join(synthesizer.voice.voices)}) or OpenAI's names")
    return resolved


def _speed(speed: object, synthesizer: SpeechSynthesizer) -> float:
    if isinstance(speed, bool) or not isinstance(speed, (int, float)):
        raise invalid_request(f"speed must be a number, not {speed!r}")
    low, high = synthesizer.voice.min_speed, synthesizer.voice.max_speed
    if not low <= float(speed) <= high:
        raise invalid_request(f"speed must be between {low:g} and {high:g} for this voice, not {speed:g}")
    return float(speed)


class _ChunkQueue:
    """Chunks from the worker thread to the event loop; None ends the stream, an exception fails it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[np.ndarray | BaseException | None] = asyncio.Queue()

    def put_threadsafe(self, item: np.ndarray | BaseException | None) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def get(self) -> np.ndarray | BaseException | None:
        return await self._queue.get()


async def speak(synthesizer: SpeechSynthesizer, request: SpeechRequest) -> Reply:
    """POST /v1/audio/speech: wav and pcm are streamed as produced, other formats sent once complete."""
    chunks = _ChunkQueue(asyncio.get_running_loop())
    job = SpeechJob(request.text, request.voice, request.speed, chunks.put_threadsafe)
    try:
        future = synthesizer.submit(job)
    except WorkerError as exc:
        raise from_worker_error(exc) from None
    future.add_done_callback(lambda done: chunks.put_threadsafe(_outcome(done)))  # type: ignore[attr-defined]
    deadline = asyncio.get_running_loop().time() + synthesizer.request_timeout_s
    media_type = MEDIA_TYPES[request.response_format]
    if request.response_format in STREAMED_FORMATS:
        try:
            first = await _next_chunk(chunks, job, deadline, synthesizer)  # errors before any byte: a status
        except BaseException:  # an error, or the client left (cancelled): stop the voice at its next sentence
            job.abort.set()
            raise
        stream = _stream_bytes(first, chunks, job, deadline, synthesizer, request.response_format)

        async def on_close() -> None:
            job.abort.set()

        return ByteStreamReply(stream, media_type, on_close, headers={"X-Sample-Rate": str(synthesizer.sample_rate)})
    pieces: list[np.ndarray] = []
    try:
        while (chunk := await _next_chunk(chunks, job, deadline, synthesizer)) is not None:
            pieces.append(chunk)
    finally:
        job.abort.set()
    samples = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    body = await asyncio.to_thread(encode_audio, samples, synthesizer.sample_rate, request.response_format)
    return BytesReply(body, media_type)


def _outcome(future: Any) -> BaseException | None:
    if future.cancelled():
        return None
    return future.exception()


async def _next_chunk(chunks: _ChunkQueue, job: SpeechJob, deadline: float,
                      synthesizer: SpeechSynthesizer) -> np.ndarray | None:
    return await next_from_worker(chunks.get, deadline, job.abort,
                                  f"the speech request took longer than {synthesizer.request_timeout_s:g} s "
                                  "(--audio-request-timeout-secs)")


async def _stream_bytes(first: np.ndarray | None, chunks: _ChunkQueue, job: SpeechJob, deadline: float,
                        synthesizer: SpeechSynthesizer, response_format: str) -> AsyncIterator[bytes]:
    if response_format == "wav":
        yield streaming_wav_header(synthesizer.sample_rate)
    chunk = first
    while chunk is not None:
        yield to_int16(chunk).tobytes()
        try:
            chunk = await _next_chunk(chunks, job, deadline, synthesizer)
        except ApiError as exc:  # the status line is gone; end the body early and say why in the log
            log.warning("speech stream ended early: %s", exc.message)
            return
