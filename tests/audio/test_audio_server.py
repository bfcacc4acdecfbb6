"""The audio routes through the real server (spec G): Whisper transcription and Piper speech.

Speech is made with espeak-ng; transcripts are scored by word error rate against the words
spoken (`MAX_WER`). The packaged checkpoints are loaded once per session by the same
`find_audio_checkpoint` / `load_audio_models` path `mlxcel serve -m NAME` takes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile

from mlxcel.serving.audio_models import AudioModels, audio_only_mode
from mlxcel.api.audio import AudioLimits
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread
from mlxcel.server.state import ServerState
from mlxcel.serving.side_models import SideModels
from mlxcel.workers.base import WorkerConfig
from mlxcel.workers.whisper import WhisperConfig, WhisperTranscriber
from tests.audio.conftest import MAX_WER, SENTENCES, word_error_rate

pytestmark = pytest.mark.slow

SERVER = ServerConfig(port=0, endpoint_metrics=True)


def audio_process(models: AudioModels) -> SideModels:
    return SideModels(mode=audio_only_mode(models.kind), audio=models)


@pytest.fixture(scope="module")
def stt(whisper: AudioModels) -> Iterator[str]:
    thread = ServerThread(ServerState(SERVER, None, side=audio_process(whisper))).start()
    yield thread.address
    thread.stop()


@pytest.fixture(scope="module")
def tts(piper: AudioModels) -> Iterator[str]:
    thread = ServerThread(ServerState(SERVER, None, side=audio_process(piper))).start()
    yield thread.address
    thread.stop()


def post_audio(address: str, path: Path | bytes, route: str = "/v1/audio/transcriptions", name: str = "clip.wav",
               **fields: str) -> httpx.Response:
    data = path.read_bytes() if isinstance(path, Path) else path
    return httpx.post(f"{address}{route}", files={"file": (name, data)}, data={"model": "whisper-1", **fields},
                      timeout=120)


# ---- transcription ----

def test_openai_sdk_transcribes_spoken_sentences(stt: str, speak: Callable[[str], Path]) -> None:
    client = openai.OpenAI(base_url=f"{stt}/v1", api_key="unused")
    heard = []
    for sentence in SENTENCES:
        with speak(sentence).open("rb") as handle:
            heard.append(client.audio.transcriptions.create(model="whisper-1", file=handle).text)
    assert word_error_rate(list(SENTENCES), heard) <= MAX_WER, heard


def test_response_formats(stt: str, speak: Callable[[str], Path]) -> None:
    clip = speak(SENTENCES[0])
    text = post_audio(stt, clip, response_format="text")
    assert text.headers["content-type"].startswith("text/plain") and text.text.endswith("\n")
    assert word_error_rate(SENTENCES[0], text.text) <= MAX_WER
    srt = post_audio(stt, clip, response_format="srt").text
    assert srt.startswith("1\n00:00:00,000 --> 00:00:0") and "corner" in srt.lower()
    vtt = post_audio(stt, clip, response_format="vtt").text
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ")
    verbose = post_audio(stt, clip, response_format="verbose_json", **{"timestamp_granularities[]": "word"}).json()
    assert verbose["task"] == "transcribe" and verbose["language"] == "english"
    assert 2.0 < verbose["duration"] < 6.0 and verbose["usage"] == {"type": "duration",
                                                                   "seconds": int(np.ceil(verbose["duration"]))}
    words = verbose["words"]
    assert [w["word"].lower().strip(".") for w in words][:3] == ["turn", "left", "at"]
    assert all(w["start"] <= w["end"] for w in words) and words[-1]["end"] <= verbose["duration"] + 0.5


def test_sdk_verbose_json_segments(stt: str, speak: Callable[[str], Path]) -> None:
    client = openai.OpenAI(base_url=f"{stt}/v1", api_key="unused")
    with speak(SENTENCES[2]).open("rb") as handle:
        result = client.audio.transcriptions.create(model="whisper-1", file=handle, response_format="verbose_json",
                                                    timestamp_granularities=["segment"])
    assert result.segments and result.segments[0].start == 0.0
    assert word_error_rate(SENTENCES[2], result.text) <= MAX_WER


def test_translation_returns_english(stt: str, speak: Callable[[str], Path]) -> None:
    # The packaged checkpoint is tiny.en (English-only): translation of its English input is English.
    response = post_audio(stt, speak(SENTENCES[1]), route="/audio/translations")
    assert response.status_code == 200
    assert word_error_rate(SENTENCES[1], response.json()["text"]) <= MAX_WER


@pytest.mark.parametrize("data, name, message", [
    (b"hello, I am a text file", "notes.txt", "not a decodable audio file"),
    (b"", "empty.wav", "empty (0 bytes)"),
    (b"\x89PNG\r\n\x1a\n" + bytes(100), "image.png", "no audio stream"),
])
def test_bad_audio_is_400(stt: str, data: bytes, name: str, message: str) -> None:
    response = post_audio(stt, data, name=name)
    assert response.status_code == 400 and message in response.json()["error"]["message"]


def test_truncated_wav_is_400(stt: str, speak: Callable[[str], Path]) -> None:
    data = speak(SENTENCES[0]).read_bytes()
    response = post_audio(stt, data[: len(data) // 3])
    assert response.status_code == 400 and "truncated WAV" in response.json()["error"]["message"]


def test_form_errors_are_400_naming_the_field(stt: str, speak: Callable[[str], Path]) -> None:
    clip = speak(SENTENCES[0])
    cases = {"response_format": "xml", "temperature": "7", "language": "de", "bogus": "1"}
    for name, value in cases.items():
        response = post_audio(stt, clip, **{name: value})
        assert response.status_code == 400, name
        assert name in response.json()["error"]["message"] or value in response.json()["error"]["message"]
    no_file = httpx.post(f"{stt}/v1/audio/transcriptions", data={"model": "whisper-1"},
                         files={"other": ("x", b"")})
    assert no_file.status_code == 400
    as_json = httpx.post(f"{stt}/v1/audio/transcriptions", json={"model": "whisper-1"})
    assert as_json.status_code == 415 and "multipart/form-data" in as_json.json()["error"]["message"]


def test_size_and_length_limits(whisper: AudioModels, speak: Callable[[str], Path]) -> None:
    clip = speak(SENTENCES[1]).read_bytes()  # about 5 s
    limited = dataclasses.replace(whisper, limits=AudioLimits(max_upload_bytes=len(clip) - 1, max_duration_s=1.0))
    thread = ServerThread(ServerState(SERVER, None, side=audio_process(limited))).start()
    try:
        too_big = post_audio(thread.address, clip)
        assert too_big.status_code == 413 and "--audio-max-upload-size" in too_big.json()["error"]["message"]
        short = dataclasses.replace(limited, limits=AudioLimits(max_duration_s=1.0))
        thread.server.state.side.audio = short  # type: ignore[attr-defined]
        too_long = post_audio(thread.address, clip)
        assert too_long.status_code == 400 and "limit of 1 s" in too_long.json()["error"]["message"]
    finally:
        thread.stop()


def test_audio_only_process_answers_chat_with_501(stt: str) -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    bodies = {"/v1/chat/completions": chat, "/v1/messages": chat, "/v1/completions": {"model": "m", "prompt": "hi"},
              "/v1/responses": {"model": "m", "input": "hi"}}
    for path, body in bodies.items():
        response = httpx.post(f"{stt}{path}", json=body)
        assert response.status_code == 501, path
        assert "audio-only" in response.text, path
    speech = httpx.post(f"{stt}/v1/audio/speech", json={"model": "tts-1", "input": "hi", "voice": "alloy"})
    assert speech.status_code == 501 and "Kokoro or Piper" in speech.json()["error"]["message"]


def test_health_models_and_metrics(stt: str, speak: Callable[[str], Path]) -> None:
    health = httpx.get(f"{stt}/health").json()
    assert health["status"] == "ok" and health["model"] == "whisper-tiny.en"
    assert health["providers"][0]["capabilities"] == ["transcription", "translation"]
    models = httpx.get(f"{stt}/v1/models").json()["data"]
    assert [(m["id"], m["capabilities"]) for m in models] == [("whisper-tiny.en", ["transcription", "translation"])]
    post_audio(stt, speak(SENTENCES[0]))
    metrics = httpx.get(f"{stt}/metrics").text
    assert 'mlxcel_worker_queue_depth{worker="whisper"}' in metrics


def test_queue_full_503_and_timeout_504(whisper: AudioModels, speak: Callable[[str], Path]) -> None:
    assert whisper.transcriber is not None
    clip = speak(" ".join(SENTENCES)).read_bytes()
    # A second worker over the same loaded model: one request running, one waiting, the rest refused.
    small = WhisperTranscriber(whisper.transcriber.model, WhisperConfig(worker=WorkerConfig(1, 1, 60.0)))
    small.start()
    busy = dataclasses.replace(whisper, transcriber=small)
    thread = ServerThread(ServerState(SERVER, None, side=audio_process(busy))).start()
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(post_audio, thread.address, clip) for _ in range(4)]
            statuses = sorted(f.result().status_code for f in futures)
        assert statuses.count(200) >= 2 and 503 in statuses, statuses
        refused = next(f.result() for f in futures if f.result().status_code == 503)
        assert refused.headers["retry-after"] == "1" and "queue is full" in refused.json()["error"]["message"]
        slow = WhisperTranscriber(whisper.transcriber.model, WhisperConfig(worker=WorkerConfig(1, 1, 0.2)))
        slow.start()
        thread.server.state.side.audio = dataclasses.replace(whisper, transcriber=slow)  # type: ignore[attr-defined]
        timed_out = post_audio(thread.address, clip)
        assert timed_out.status_code == 504 and "0.2 s" in timed_out.json()["error"]["message"]
        assert slow.stop(30)  # the abandoned job stopped at its next segment; the thread joins
    finally:
        thread.stop()
        assert small.stop(30)


# ---- speech ----

def test_openai_sdk_speech_round_trips_through_whisper(tts: str, whisper: AudioModels) -> None:
    assert whisper.transcriber is not None
    client = openai.OpenAI(base_url=f"{tts}/v1", api_key="unused")
    sentence = "Good morning. The meeting starts at nine o'clock in the small room."
    response = client.audio.speech.create(model="tts-1", voice="alloy", input=sentence, response_format="wav")
    samples, rate = soundfile.read(io.BytesIO(response.content), dtype="float32")
    assert rate == 22050 and 2.0 < len(samples) / rate < 10.0
    from mlxcel.workers.audio_io import decode_audio
    from mlxcel.workers.whisper import TranscriptionJob

    heard = whisper.transcriber.transcribe_sync(TranscriptionJob(decode_audio(response.content,
                                                                              max_duration_s=60).samples))
    assert word_error_rate(sentence, heard.text) <= MAX_WER, heard.text


def test_speech_formats_speed_and_streaming(tts: str) -> None:
    body = {"model": "tts-1", "voice": "en_US-joe-medium", "input": "One sentence here. And a second one."}
    durations = {}
    for fmt in ("mp3", "flac", "wav"):
        response = httpx.post(f"{tts}/v1/audio/speech", json={**body, "response_format": fmt}, timeout=120)
        assert response.status_code == 200 and response.headers["content-type"] == f"audio/{'mpeg' if fmt == 'mp3' else fmt}"
        samples, rate = soundfile.read(io.BytesIO(response.content), dtype="float32")
        durations[fmt] = len(samples) / rate
    assert abs(durations["mp3"] - durations["wav"]) < 0.3
    pcm = httpx.post(f"{tts}/v1/audio/speech", json={**body, "response_format": "pcm"}, timeout=120)
    assert abs(len(pcm.content) / 2 / 22050 - durations["wav"]) < 0.3  # Piper's own sampling is noisy; close
    fast = httpx.post(f"{tts}/v1/audio/speech", json={**body, "response_format": "pcm", "speed": 2.0}, timeout=120)
    assert len(fast.content) < 0.7 * len(pcm.content)
    with httpx.stream("POST", f"{tts}/v1/audio/speech", json={**body, "response_format": "wav"}, timeout=120) as r:
        assert "content-length" not in r.headers  # sent as produced (chunked), sentence by sentence
        pieces = [len(chunk) for chunk in r.iter_raw()]
    assert pieces[0] == 44 or len(pieces) >= 2


def test_speech_errors(tts: str) -> None:
    cases = [({"voice": "nobody", "input": "hi"}, "voice 'nobody'"),
             ({"voice": "alloy", "input": ""}, "input"),
             ({"voice": "alloy", "input": "x" * 5000}, "over the limit"),
             ({"voice": "alloy", "input": "hi", "response_format": "aiff"}, "response_format"),
             ({"voice": "alloy", "input": "hi", "speed": 9}, "speed")]
    for body, message in cases:
        response = httpx.post(f"{tts}/v1/audio/speech", json={"model": "tts-1", **body})
        assert response.status_code == 400 and message in response.json()["error"]["message"], body
    transcribe = post_audio(tts, b"x")
    assert transcribe.status_code == 501 and "Whisper" in transcribe.json()["error"]["message"]


def test_kokoro_speech_round_trips_through_whisper(kokoro: AudioModels, whisper: AudioModels) -> None:
    assert whisper.transcriber is not None
    thread = ServerThread(ServerState(SERVER, None, side=audio_process(kokoro))).start()
    try:
        sentence = "Please open the window."
        response = httpx.post(f"{thread.address}/v1/audio/speech", timeout=300,
                              json={"model": "kokoro", "voice": "jf_alpha", "input": sentence, "response_format": "wav"})
        assert response.status_code == 200
        samples, rate = soundfile.read(io.BytesIO(response.content), dtype="float32")
        assert rate == 24_000 and 0.5 < len(samples) / rate < 6.0
        from mlxcel.workers.audio_io import decode_audio
        from mlxcel.workers.whisper import TranscriptionJob

        heard = whisper.transcriber.transcribe_sync(TranscriptionJob(decode_audio(response.content,
                                                                                  max_duration_s=60).samples))
        assert word_error_rate(sentence, heard.text) <= MAX_WER, heard.text
        japanese = httpx.post(f"{thread.address}/v1/audio/speech", timeout=300,
                              json={"model": "kokoro", "voice": "jf_alpha", "input": "こんにちは。", "response_format": "pcm"})
        assert japanese.status_code == 200  # the voices' own language, through the Japanese G2P
        spoken = np.frombuffer(japanese.content, "<i2").astype(np.float32) / 32768
        assert 0.3 < spoken.size / 24_000 < 3.0 and float(np.abs(spoken).max()) > 0.05
        models = httpx.get(f"{thread.address}/v1/models").json()["data"]
        assert models[0]["id"] == "kokoro-82m" and models[0]["capabilities"] == ["speech"]
    finally:
        thread.stop()


def test_speech_queue_full_503_and_timeout_504(piper: AudioModels) -> None:
    from mlxcel.workers.speech import SpeechConfig, SpeechSynthesizer

    assert piper.synthesizer is not None
    text = " ".join(["This is a long sentence that keeps the voice busy for a while."] * 4)
    small = SpeechSynthesizer(piper.synthesizer.voice, SpeechConfig(worker=WorkerConfig(1, 1, 120.0)))
    small.start()
    thread = ServerThread(ServerState(SERVER, None, side=audio_process(
        dataclasses.replace(piper, synthesizer=small)))).start()

    def say() -> httpx.Response:
        return httpx.post(f"{thread.address}/v1/audio/speech", timeout=300,
                          json={"model": "tts-1", "voice": "alloy", "input": text, "response_format": "mp3"})

    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            statuses = sorted(f.result().status_code for f in [pool.submit(say) for _ in range(4)])
        assert statuses.count(200) >= 2 and 503 in statuses, statuses
        slow = SpeechSynthesizer(piper.synthesizer.voice, SpeechConfig(worker=WorkerConfig(1, 1, 0.05)))
        slow.start()
        thread.server.state.side.audio = dataclasses.replace(piper, synthesizer=slow)  # type: ignore[attr-defined]
        for fmt in ("wav", "mp3"):  # streamed or not, no byte has gone out when the deadline passes
            late = httpx.post(f"{thread.address}/v1/audio/speech", timeout=300,
                              json={"model": "tts-1", "voice": "alloy", "input": text, "response_format": fmt})
            assert late.status_code == 504 and "--audio-request-timeout-secs" in late.json()["error"]["message"]
        assert slow.stop(60)
    finally:
        thread.stop()
        assert small.stop(60)
