"""What one process serves: the products of the startup path (`mlxcel.startup`), as plain data.

`Process` is the one object the builder hands the server: the served chat model (or None), the
side models (`SideModels`: embedding and rerank providers, an audio-only or realtime process's
models, a Florence-2 process's worker, the single-purpose mode) and the settings they were built
from. Nothing loads here, so `server/` can hold and read these without importing the loaders
(`served_model`, `chat_model`, `side_models`, `workers`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mlxcel.api.modes import ModelEntry, SinglePurposeMode

if TYPE_CHECKING:
    from mlxcel.serving.audio_models import AudioModels
    from mlxcel.serving.served_model import ServedModel
    from mlxcel.workers.base import WorkerStats
    from mlxcel.workers.embedding import EmbeddingProvider
    from mlxcel.workers.florence2 import Florence2Provider
    from mlxcel.workers.image import ImageGenerator
    from mlxcel.workers.rerank import Reranker

FLORENCE2_CAPABILITY = "vision"  # /v1/models: image tasks on /v1/chat/completions (spec T)
Stopper = Callable[[float], bool]  # stop(timeout) -> exited in time (A7)


@dataclass(frozen=True, slots=True)
class NamedProvider:
    name: str  # the id /v1/models lists and responses carry
    window: int  # longest input in tokens
    created: int


@dataclass
class SideModels:
    """The providers one process serves, and its single-purpose mode when chat is not served."""

    embedding: EmbeddingProvider | None = None
    embedding_info: NamedProvider | None = None
    reranker: Reranker | None = None
    reranker_info: NamedProvider | None = None
    image: ImageGenerator | None = None  # --image-model's pipeline (spec J)
    image_info: NamedProvider | None = None
    mode: SinglePurposeMode | None = None
    audio: AudioModels | None = None  # the provider of an audio-only process (spec G)
    realtime: tuple[AudioModels, AudioModels] | None = None  # (Whisper, voice) of a realtime process (spec H)
    realtime_entry: ModelEntry | None = None  # the realtime model as /v1/models lists it
    florence2: Florence2Provider | None = None  # a Florence-2 process's seq2seq worker (spec T)
    florence2_info: NamedProvider | None = None
    # (name, stop(timeout) -> exited in time) per provider thread, joined at shutdown (A7)
    stoppers: list[tuple[str, Stopper]] = field(default_factory=list)

    def stats(self) -> list[WorkerStats]:
        providers = (self.embedding, self.reranker, self.image)
        stats = [provider.stats() for provider in providers if provider is not None]
        audio = [self.audio] if self.audio is not None else list(self.realtime or ())
        florence2 = [self.florence2.stats()] if self.florence2 is not None else []
        return stats + [models.stats() for models in audio] + florence2

    def model_entries(self) -> list[ModelEntry]:
        """The providers as /v1/models lists them, each with its capability."""
        entries = [(self.embedding_info, "embedding"), (self.reranker_info, "rerank"),
                   (self.florence2_info, FLORENCE2_CAPABILITY), (self.image_info, "image")]
        listed = [ModelEntry(info.name, (capability,), info.created, info.window)
                  for info, capability in entries if info is not None]
        listed += [self.audio.model_entry()] if self.audio is not None else []
        return listed + ([self.realtime_entry] if self.realtime_entry is not None else [])

    def stop(self, timeout: float = 120.0) -> bool:
        return all([stop(timeout) for _, stop in self.stoppers])


@dataclass
class Process:
    """The served models of one process, built in A6 order from the settings (`startup.build_process`)."""

    served: ServedModel | None
    side: SideModels = field(default_factory=SideModels)
    values: Mapping[str, Any] = field(default_factory=dict)  # every setting's startup value (/v1/settings)

    def stoppers(self) -> list[tuple[str, Stopper]]:
        """Side workers first: they stop taking requests before the chat engine goes (A7)."""
        chat = [("chat engine", self.served.close)] if self.served is not None else []
        return [(f"{name} worker", stop) for name, stop in self.side.stoppers] + chat
