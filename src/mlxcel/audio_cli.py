"""`mlxcel generate` with audio (spec G, H): `--audio IN.wav` and `--output-audio OUT.wav`.

- `-m WHISPER --audio IN.wav`: the transcript to stdout.
- `-m KOKORO_OR_PIPER -p TEXT --output-audio OUT.wav`: the text spoken into a WAV file.
- `-m CHAT --realtime-stt WHISPER --realtime-tts VOICE --audio IN.wav --output-audio OUT.wav`:
  one voice turn of the realtime cascade (the source's VoiceChat CLI form): what was heard and
  the answer go to stderr and stdout, the spoken answer to OUT.wav.
Each model is loaded by the path `serve` uses and runs on its own worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from mlxcel.env import Environment

log = logging.getLogger("mlxcel")


def run_audio_generate(values: dict[str, Any], environment: Environment) -> int:
    from mlxcel.serving.audio_models import AudioOptions, find_audio_checkpoint, load_audio_models
    from mlxcel.loading import ModelLoadError, resolve_model
    from mlxcel.workers.audio_io import AudioInputError

    def resolve(arg: str | None) -> Any:
        return resolve_model(arg, models_dir=values["models_dir"], default_org=environment["MLXCEL_DEFAULT_ORG"])

    options = AudioOptions(beam_size=values["audio_beam_size"], threads=values["threads"] or 0,
                           request_timeout_s=3600.0)
    try:
        if values["realtime_stt"] or values["realtime_tts"]:
            return _voice_turn(values, resolve, options)
        found = find_audio_checkpoint(values["model"], resolve)
        if found is None:
            log.error("generate: --audio / --output-audio need -m naming a Whisper, Kokoro or Piper checkpoint, or "
                      "--realtime-stt and --realtime-tts beside a chat -m")
            return 2
        models = load_audio_models(found, options, int(time.time()))
    except (ModelLoadError, ValueError, OSError) as exc:
        log.error("cannot load the model: %s", exc)
        return 1
    try:
        if models.transcriber is not None:
            return _transcribe(models.transcriber, values)
        return _speak(models.synthesizer, values)
    except (AudioInputError, ValueError, OSError) as exc:
        log.error("generate: %s", exc)
        return 1
    finally:
        for _, stop in models.stoppers:
            stop(30.0)


def _read_audio(path: Path | None) -> np.ndarray:
    from mlxcel.workers.audio_io import decode_audio

    if path is None:
        raise ValueError("--audio IN.wav is required with a Whisper model")
    return decode_audio(path.read_bytes(), max_duration_s=24 * 3600.0, filename=str(path)).samples


def _transcribe(transcriber: Any, values: dict[str, Any]) -> int:
    from mlxcel.workers.whisper import TranscriptionJob

    started = time.monotonic()
    samples = _read_audio(values["audio"])
    transcript = transcriber.transcribe_sync(TranscriptionJob(samples))
    sys.stdout.write(transcript.text + "\n")
    seconds = time.monotonic() - started
    sys.stderr.write(f"audio: {transcript.duration_s:.1f} s, transcribed in {seconds:.1f} s "
                     f"(real-time factor {seconds / max(transcript.duration_s, 1e-9):.2f})\n")
    return 0


def _speak(synthesizer: Any, values: dict[str, Any]) -> int:
    from mlxcel.workers.speech import SpeechJob

    if not values["prompt"] or values["output_audio"] is None:
        raise ValueError("a voice model speaks -p TEXT into --output-audio OUT.wav; give both")
    chunks: list[np.ndarray] = []
    started = time.monotonic()
    synthesizer.run_sync(SpeechJob(values["prompt"], synthesizer.voice.voices[0], 1.0, chunks.append))
    samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    _write_wav(values["output_audio"], samples, synthesizer.sample_rate)
    seconds, duration = time.monotonic() - started, samples.size / synthesizer.sample_rate
    sys.stderr.write(f"speech: {duration:.1f} s written to {values['output_audio']} in {seconds:.1f} s "
                     f"(real-time factor {seconds / max(duration, 1e-9):.2f})\n")
    return 0


def _write_wav(path: Path, samples: np.ndarray, rate: int) -> None:
    from mlxcel.workers.audio_io import encode_audio

    path.write_bytes(encode_audio(samples, rate, "wav"))


def _voice_turn(values: dict[str, Any], resolve: Any, options: Any) -> int:
    from mlxcel.api.context import ApiContext
    from mlxcel.api.realtime import SAMPLE_RATE, AudioDelta, InputTranscript, TextDelta, Turn
    from mlxcel.api.realtime_cascade import CascadeEngine, resample
    from mlxcel.serving.audio_models import find_audio_checkpoint, load_audio_models
    from mlxcel.config import EngineConfig
    from mlxcel.serving.chat_model import start_served_model
    from mlxcel.serving.served_model import RuntimeOptions
    from mlxcel.workers.audio_io import WHISPER_SAMPLE_RATE

    if not (values["realtime_stt"] and values["realtime_tts"] and values["audio"] and values["output_audio"]):
        raise ValueError("a voice turn needs --realtime-stt, --realtime-tts, --audio IN.wav and --output-audio OUT.wav")
    stt = find_audio_checkpoint(values["realtime_stt"], resolve)
    tts = find_audio_checkpoint(values["realtime_tts"], resolve)
    if stt is None or tts is None:
        raise ValueError("--realtime-stt needs a Whisper checkpoint and --realtime-tts a Kokoro or Piper one")
    created = int(time.time())
    ears, voice = load_audio_models(stt, options, created), load_audio_models(tts, options, created)
    served = start_served_model(resolve(values["model"]), RuntimeOptions(warmup=False, threads=values["threads"]),
                                EngineConfig(max_num_seqs=1, ctx_size=values["ctx_size"]))
    try:
        ctx = ApiContext(served.name, served.engine, served.tokenizer, served.chat_template, served.context_size,
                         created, served.features)
        engine = CascadeEngine(ears.transcriber, ctx, voice.synthesizer)  # type: ignore[arg-type]
        audio = resample(_read_audio(values["audio"]), WHISPER_SAMPLE_RATE, SAMPLE_RATE)
        turn = Turn(audio, (), None, "alloy", values["max_tokens"], values["temperature"])
        pcm: list[bytes] = []

        async def run() -> None:
            async for event in engine.respond(turn):
                if isinstance(event, InputTranscript):
                    sys.stderr.write(f"heard: {event.text}\n")
                elif isinstance(event, TextDelta):
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
                elif isinstance(event, AudioDelta):
                    pcm.append(event.pcm16)

        asyncio.run(run())
        sys.stdout.write("\n")
        samples = np.frombuffer(b"".join(pcm), "<i2").astype(np.float32) / 32768.0
        _write_wav(values["output_audio"], samples, SAMPLE_RATE)
        sys.stderr.write(f"spoken answer: {samples.size / SAMPLE_RATE:.1f} s written to {values['output_audio']}\n")
        return 0
    finally:
        served.close()
        for _, stop in ears.stoppers + voice.stoppers:
            stop(30.0)
