"""Audio-only processes (spec G): a Whisper, Piper or Kokoro checkpoint as `-m`.

The source gives audio checkpoints their own server slot: a Whisper process transcribes and
translates, a Kokoro (or Piper) process speaks, and neither runs beside chat generation, so
there is no `--audio-model` flag. `find_audio_checkpoint` looks at `-m` before the chat loader
does: an existing path (`-m ./models/whisper-base`), a packaged name (`whisper-tiny.en`,
`en_US-joe-medium`, `kokoro-82m`) or a hub repo id resolved like any model. The files are
checked (`verify_audio_checkpoint`) before the model loads on its worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mlxcel.api.audio import AudioLimits
from mlxcel.api.modes import ModelEntry, SinglePurposeMode
from mlxcel.loading import ModelLoadError, ResolvedModel
from mlxcel.workers.audio_checkpoints import (
    AudioCheckpoint, AudioKind, detect_audio_checkpoint, packaged_audio, verify_audio_checkpoint,
)
from mlxcel.workers.base import WorkerConfig, WorkerStats
from mlxcel.workers.speech import SpeechConfig, SpeechSynthesizer
from mlxcel.workers.whisper import WhisperConfig, WhisperTranscriber

log = logging.getLogger(__name__)

Resolve = Callable[[str | None], ResolvedModel]


@dataclass(frozen=True, slots=True)
class AudioOptions:
    """The audio flags, validated."""

    queue_depth: int = 8  # --audio-queue-depth
    request_timeout_s: float = 120.0  # --audio-request-timeout-secs
    limits: AudioLimits = AudioLimits()  # --audio-max-upload-size, --audio-max-duration-secs
    beam_size: int = 5  # --audio-beam-size
    threads: int = 0  # --threads (0 = the library's default)
    device: str = "cpu"

    def __post_init__(self) -> None:
        checks = ((self.queue_depth >= 1, f"--audio-queue-depth must be at least 1, not {self.queue_depth}"),
                  (self.request_timeout_s > 0, "--audio-request-timeout-secs must be positive, not "
                   f"{self.request_timeout_s}"),
                  (self.limits.max_upload_bytes >= 1, "--audio-max-upload-size must be at least 1 byte"),
                  (self.limits.max_duration_s > 0, "--audio-max-duration-secs must be positive"),
                  (self.beam_size >= 1, f"--audio-beam-size must be at least 1, not {self.beam_size}"))
        for is_ok, message in checks:
            if not is_ok:
                raise ValueError(message)

    @property
    def worker(self) -> WorkerConfig:
        return WorkerConfig(self.queue_depth, 1, self.request_timeout_s)


@dataclass(frozen=True, slots=True)
class FoundAudio:
    checkpoint: AudioCheckpoint
    name: str  # what /v1/models lists
    source: str  # for the startup log


def find_audio_checkpoint(model_arg: str | None, resolve: Resolve) -> FoundAudio | None:
    """The audio checkpoint `-m` names, or None when it names something else (a chat model ...)."""
    if not model_arg:
        return None
    path = Path(model_arg).expanduser()
    if path.exists():
        checkpoint = detect_audio_checkpoint(path)
        return FoundAudio(checkpoint, _display_name(path), f"local path {path}") if checkpoint else None
    packaged = packaged_audio(model_arg)
    if packaged is not None:
        located = packaged.locate()
        checkpoint = detect_audio_checkpoint(located)
        if checkpoint is None:
            raise ModelLoadError(f"{model_arg}: the packaged files in {located} are not an audio checkpoint")
        return FoundAudio(checkpoint, packaged.name, f"packaged checkpoint {packaged.distribution}")
    try:
        resolved = resolve(model_arg)
    except ModelLoadError:
        return None  # let the chat loader report it with its own message
    checkpoint = detect_audio_checkpoint(resolved.path)
    return FoundAudio(checkpoint, resolved.name, resolved.source) if checkpoint else None


def _display_name(path: Path) -> str:
    return path.name.removesuffix(".onnx") if path.is_file() else path.resolve().name


def audio_only_mode(kind: AudioKind) -> SinglePurposeMode:
    serves = "audio transcription and translation" if kind.is_speech_to_text else "speech synthesis"
    return SinglePurposeMode("audio-only", "-m", "To serve chat, start another process with -m CHAT_MODEL; an "
                             "audio checkpoint is served in its own process.", serves=serves)


@dataclass
class AudioModels:
    """The audio provider of an audio-only process."""

    kind: AudioKind
    name: str
    created: int
    transcriber: WhisperTranscriber | None = None
    synthesizer: SpeechSynthesizer | None = None
    limits: AudioLimits = AudioLimits()
    stoppers: list[tuple[str, Callable[[float], bool]]] = field(default_factory=list)

    @property
    def capabilities(self) -> tuple[str, ...]:
        return ("transcription", "translation") if self.transcriber is not None else ("speech",)

    def stats(self) -> WorkerStats:
        provider = self.transcriber or self.synthesizer
        assert provider is not None
        return provider.stats()

    def model_entry(self) -> ModelEntry:
        return ModelEntry(self.name, self.capabilities, self.created, 0)


def load_audio_models(found: FoundAudio, options: AudioOptions, created: int) -> AudioModels:
    """Verify the checkpoint's files, load it and start its worker thread."""
    checkpoint = found.checkpoint
    verify_audio_checkpoint(checkpoint)
    models = AudioModels(checkpoint.kind, found.name, created, limits=options.limits)
    if checkpoint.kind is AudioKind.WHISPER:
        config = WhisperConfig(beam_size=options.beam_size, cpu_threads=options.threads, device=options.device,
                               worker=options.worker)
        models.transcriber = WhisperTranscriber.load(checkpoint.folder, config)
        models.stoppers.append(("whisper", models.transcriber.stop))
        log.info("audio model: %s (%s, Whisper %s, beam %d)", found.name, found.source,
                 "multilingual" if models.transcriber.is_multilingual else "English-only", options.beam_size)
    else:
        models.synthesizer = SpeechSynthesizer.load(checkpoint, SpeechConfig(options.threads, options.worker))
        models.stoppers.append(("speech", models.synthesizer.stop))
        log.info("audio model: %s (%s, %s voice, %d Hz, voices %s)", found.name, found.source, checkpoint.kind.value,
                 models.synthesizer.sample_rate, ", ".join(models.synthesizer.voice.voices))
    return models
