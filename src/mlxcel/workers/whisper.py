"""The Whisper provider (spec G): faster-whisper (CTranslate2) behind a one-at-a-time worker.

Its worker thread is the only user of the model (DESIGN rule 4). A job carries decoded 16 kHz
samples; the thread runs the whole transcription (faster-whisper yields segments lazily, so
they are consumed there) and checks the job's abort flag between segments, so a request that
timed out or whose client left stops costing CPU at the next segment.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from mlxcel.loading.errors import ModelLoadError
from mlxcel.workers.base import BatchWorker, WorkerConfig, WorkerStats

log = logging.getLogger(__name__)

Task = Literal["transcribe", "translate"]
DEFAULT_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # faster-whisper's (and OpenAI's) fallback ladder


class TranscriptionAborted(RuntimeError):
    """The job was abandoned (timeout, client gone) before it finished."""


@dataclass(frozen=True, slots=True)
class WhisperConfig:
    beam_size: int = 5
    cpu_threads: int = 0  # 0 = CTranslate2's default
    compute_type: str = "auto"  # auto: int8 on CPU (faster-whisper's CPU advice), the saved type elsewhere
    device: str = "cpu"
    worker: WorkerConfig = WorkerConfig(queue_depth=8, batch_size=1, request_timeout_s=120.0)


@dataclass(slots=True)
class TranscriptionJob:
    samples: np.ndarray  # [num_samples] float32, 16 kHz mono
    task: Task = "transcribe"
    language: str | None = None
    prompt: str | None = None
    temperature: float | None = None  # None = the fallback ladder
    word_timestamps: bool = False
    abort: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True, slots=True)
class Word:
    start: float
    end: float
    word: str
    probability: float


@dataclass(frozen=True, slots=True)
class Segment:
    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: tuple[int, ...]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    words: tuple[Word, ...] = ()


@dataclass(frozen=True, slots=True)
class Transcript:
    task: Task
    language: str
    duration_s: float
    segments: tuple[Segment, ...]

    @property
    def text(self) -> str:
        return "".join(segment.text for segment in self.segments).strip()

    @property
    def words(self) -> tuple[Word, ...]:
        return tuple(word for segment in self.segments for word in segment.words)


class WhisperTranscriber:
    """A loaded Whisper model and its worker thread."""

    def __init__(self, model: object, config: WhisperConfig, name: str = "audio") -> None:
        self.model = model
        self.config = config
        self.is_multilingual = bool(getattr(getattr(model, "model"), "is_multilingual"))
        self.languages = tuple(getattr(model, "supported_languages", ()) or ("en",))
        self._worker: BatchWorker[TranscriptionJob, Transcript] = BatchWorker(
            name, self._forward, config.worker)

    @classmethod
    def load(cls, folder: Path, config: WhisperConfig) -> WhisperTranscriber:
        from faster_whisper import WhisperModel

        try:
            compute_type = config.compute_type
            if compute_type == "auto":
                compute_type = "int8" if config.device == "cpu" else "default"
            model = WhisperModel(str(folder), device=config.device, compute_type=compute_type,
                                 cpu_threads=config.cpu_threads, num_workers=1, local_files_only=True)
        except (RuntimeError, ValueError, OSError) as exc:
            raise ModelLoadError(f"{folder}: faster-whisper could not load it ({exc})") from None
        transcriber = cls(model, config, name="whisper")
        transcriber.start()
        return transcriber

    def start(self) -> None:
        self._worker.start()

    def stop(self, timeout: float | None = None) -> bool:
        return self._worker.stop(timeout)

    def stats(self) -> WorkerStats:
        return self._worker.stats()

    async def transcribe(self, job: TranscriptionJob) -> Transcript:
        """Run one job on the worker thread (503 when the queue is full, 504 past the deadline)."""
        try:
            return (await self._worker.run([job]))[0]
        finally:
            job.abort.set()  # finished, timed out or cancelled: a still-running job stops at its next segment

    def transcribe_sync(self, job: TranscriptionJob) -> Transcript:
        try:
            return self._worker.run_sync([job])[0]
        finally:
            job.abort.set()

    # --- worker thread ---

    def _forward(self, jobs: list[TranscriptionJob]) -> list[Transcript]:
        return [self._run(job) for job in jobs]

    def _run(self, job: TranscriptionJob) -> Transcript:
        segments, info = self.model.transcribe(  # type: ignore[attr-defined]
            job.samples, task=job.task, language=job.language, initial_prompt=job.prompt or None,
            temperature=DEFAULT_TEMPERATURES if job.temperature is None else job.temperature,
            beam_size=self.config.beam_size, word_timestamps=job.word_timestamps, vad_filter=False)
        collected: list[Segment] = []
        for raw in segments:
            if job.abort.is_set() or self._worker.is_past_deadline():  # past it: the worker answers 504
                raise TranscriptionAborted("transcription abandoned")
            collected.append(_segment(raw))
        return Transcript(job.task, str(info.language), float(info.duration), tuple(collected))


def _segment(raw: object) -> Segment:
    words = tuple(Word(float(w.start), float(w.end), str(w.word), float(w.probability))
                  for w in (getattr(raw, "words", None) or ()))
    get = raw.__getattribute__
    return Segment(int(get("id")) - 1, int(get("seek")), float(get("start")), float(get("end")), str(get("text")),
                   tuple(get("tokens")), float(get("temperature") or 0.0), float(get("avg_logprob")),
                   float(get("compression_ratio")), float(get("no_speech_prob")), words)
