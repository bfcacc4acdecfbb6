"""The one object an app holds: configuration, the served model once loaded, metrics, lifecycle.

It also owns how a live setting (F9) takes effect on what it holds (`APPLIERS`: the served
model's chat features, the engine, the log level), for `PATCH /v1/settings` and for a model
attached later. What startup puts beside it (the realtime service, the web UI's model control)
it holds without importing their modules: the model control only as `ModelActions`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from mlxcel.api.context import SAMPLER_NAMES, ApiContext, SamplingDefaults
from mlxcel.api.errors import unavailable
from mlxcel.api.modes import audio_missing, chat_not_served, provider_missing
from mlxcel.api.responses import ResponsesService
from mlxcel.api.resumable import StreamBufferLimits, StreamStore
from mlxcel.media.limits import MediaPolicy
from mlxcel.settings import LiveSettings
from mlxcel.serving.process import SideModels
from mlxcel.server.config import ServerConfig
from mlxcel.server.metrics import ServerMetrics
from mlxcel.types import EngineStats

if TYPE_CHECKING:  # what the startup path built (mlxcel.startup); the server holds it, never loads it
    from mlxcel.serving.served_model import ServedModel
    from mlxcel.workers.base import WorkerStats
    from mlxcel.workers.embedding import EmbeddingProvider
    from mlxcel.workers.image import ImageGenerator
    from mlxcel.workers.rerank import Reranker
    from mlxcel.workers.speech import SpeechSynthesizer
    from mlxcel.workers.whisper import WhisperTranscriber
    from mlxcel.api.realtime import RealtimeService


class ModelActions(Protocol):
    """What the state reads of the web UI's model control (server/model_control.ModelControl)."""

    @property
    def loading(self) -> Mapping[str, str]:
        """role -> the model id being loaded for it."""


class ServerState:
    """Shared by every route of one app; `served` is None until the model is attached."""

    def __init__(self, config: ServerConfig, served: ServedModel | None = None, *, side: SideModels | None = None,
                 media: MediaPolicy | None = None, settings: Mapping[str, Any] | None = None) -> None:
        self.config = config
        self.live = LiveSettings(settings)  # F9: startup values from the settings table, PATCHed at run time
        self.side = side or SideModels()  # embedding / rerank providers (spec I)
        self.media = media or MediaPolicy()  # C2-C5, handed to adapters through ApiContext
        self.metrics = ServerMetrics(self.engine_stats, self.worker_stats)
        self.responses = ResponsesService.open(config.responses_db)  # stored Responses (F2), model or not
        self.streams = StreamStore(StreamBufferLimits(  # F6: resumable streams
            config.stream_buffer_streams, config.stream_buffer_bytes, config.stream_buffer_ttl_s,
            config.sse_keepalive_s))
        self.served: ServedModel | None = None
        self.api: ApiContext | None = None
        self.is_shutting_down = False
        self.started_at = time.time()  # Process-Start-Time-Unix on /metrics (llama-server)
        self.realtime: RealtimeService | None = None  # /v1/realtime (spec H), set before the app is built
        self.control: ModelActions | None = None  # --webui's model actions (A5), set before the app is built
        if served is not None:
            self.attach(served)

    @property
    def model_name(self) -> str | None:
        if self.served is None:
            return self._single_purpose_name()
        return self._alias_or(self.served.name)

    def _alias_or(self, name: str) -> str:
        aliases = self.config.aliases
        return aliases[0] if aliases else name

    def _single_purpose_name(self) -> str | None:
        if self.side.mode is None:
            return None
        if self.side.audio is not None:
            return self.side.audio.name
        if self.side.image_info is not None and self.side.mode.name == "image-only":
            return self.side.image_info.name  # already --alias's first name (spec J)
        info = self.side.florence2_info or self.side.embedding_info or self.side.reranker_info
        return info.name if info else None

    def attach(self, served: ServedModel) -> None:
        """Start serving `served` (the model is loaded and warmed up)."""
        self.served = served
        self.api = ApiContext(
            model_name=self._alias_or(served.name), engine=served.engine, tokenizer=served.tokenizer,
            chat_template=served.chat_template, context_size=served.context_size, created=int(time.time()),
            telemetry=self.metrics, sse_keepalive_s=self.config.sse_keepalive_s, media_policy=self.media,
            features=served.features, aliases=self.config.aliases, tags=self.config.tags,
            lora=served.lora, sampling=sampling_defaults(self.live.current, served.checkpoint_sampling),
            image_marker=served.image_marker, weights=served.weights, image_prompter=served.image_prompter)
        engine = served.engine_config
        for name, value in (("parallel", engine.max_num_seqs),  # after the model's own clamp (A3)
                            ("default_n_predict", engine.n_predict), ("default_seed", engine.seed)):
            self.live.observe(name, value)  # /props and /v1/settings show what the engine runs with
        self.apply_live_settings()

    def apply_setting(self, name: str, value: Any) -> None:
        """Make the live setting `name` take effect (F9; the value is valid)."""
        APPLIERS[name](self, value)

    def apply_live_settings(self) -> None:
        """Re-apply every mutable value that differs from startup (a model attached after a PATCH)."""
        for name, value in self.live.current.items():
            if name in APPLIERS and value != self.live.startup[name]:
                self.apply_setting(name, value)

    def detach(self) -> None:
        """Stop routing requests to the served model (A5 unload); in-flight ones keep their context."""
        self.served = None
        self.api = None

    def engine_stats(self) -> EngineStats | None:
        return self.served.engine.stats() if self.served is not None else None

    def is_engine_recovering(self) -> bool:
        """A dead engine process is being replaced by a new one (issue 44)."""
        return self.served is not None and getattr(self.served.engine.core, "is_recovering", False)

    def engine_failed(self) -> bool:
        """True once the chat engine's loop thread died (the process must not go on serving); not while a dead
        engine process is being replaced (issue 44: /health says 503 meanwhile)."""
        return self.served is not None and not self.served.engine.core.is_alive and not self.is_engine_recovering()

    def worker_stats(self) -> list[WorkerStats]:
        return self.side.stats()

    def require_api(self) -> ApiContext:
        """The API context, or 503 while loading or shutting down."""
        if self.is_shutting_down:
            raise unavailable("the server is shutting down")
        if self.side.mode is not None:  # embedding-only / rerank-only process: 501 naming the mode (spec I)
            raise chat_not_served(self.side.mode)
        if self.api is None:
            if self.config.webui and (self.control is None or not self.control.loading):
                raise unavailable("no model loaded: load one from the web UI (/webui/) or POST "
                                  "/ui-api/v1/models/load")  # A5 model-less start
            raise unavailable("Loading model")
        return self.api

    def require_served(self) -> ServedModel:
        self.require_api()
        assert self.served is not None
        return self.served

    def require_embedding(self) -> tuple[EmbeddingProvider, str]:
        """The embedding provider and its model id, or 501 naming --embedding-model (spec I)."""
        if self.is_shutting_down:
            raise unavailable("the server is shutting down")
        provider, info = self.side.embedding, self.side.embedding_info
        if provider is None or info is None:
            raise provider_missing("embeddings", "--embedding-model")
        return provider, info.name

    def require_reranker(self) -> tuple[Reranker, str]:
        """The reranker and its model id, or 501 naming --reranker-model (spec I)."""
        if self.is_shutting_down:
            raise unavailable("the server is shutting down")
        reranker, info = self.side.reranker, self.side.reranker_info
        if reranker is None or info is None:
            raise provider_missing("reranking", "--reranker-model")
        return reranker, info.name

    def require_image(self) -> tuple[ImageGenerator, str]:
        """The image provider and its model id; the image routes are mounted only with one (spec J)."""
        if self.is_shutting_down:
            raise unavailable("the server is shutting down")
        generator, info = self.side.image, self.side.image_info
        assert generator is not None and info is not None, "image routes are mounted only with --image-model"
        return generator, info.name

    def require_transcriber(self) -> WhisperTranscriber:
        """The Whisper provider, or 501 saying what serves transcription (spec G)."""
        if self.is_shutting_down:
            raise unavailable("the server is shutting down")
        audio = self.side.audio
        if audio is None or audio.transcriber is None:
            raise audio_missing("transcription and translation", "a Whisper checkpoint",
                                audio.name if audio else None)
        return audio.transcriber

    def require_synthesizer(self) -> SpeechSynthesizer:
        """The speech provider, or 501 saying what serves speech (spec G)."""
        if self.is_shutting_down:
            raise unavailable("the server is shutting down")
        audio = self.side.audio
        if audio is None or audio.synthesizer is None:
            raise audio_missing("speech synthesis", "a Kokoro or Piper checkpoint", audio.name if audio else None)
        return audio.synthesizer


# ---- live settings (F9): how each mutable setting takes effect on the next request ----

Applier = Callable[[ServerState, Any], None]
SAMPLING_DEFAULTS = SAMPLER_NAMES  # each the setting `default_<name>`


def _features(state: ServerState, **changes: Any) -> None:
    """Swap the served model's chat features; requests already planned keep theirs."""
    if state.served is None or state.api is None:
        return  # nothing attached: `ServerState.attach` applies the live values when a model comes
    features = replace(state.served.features, **changes)
    state.served.features = features
    state.api = replace(state.api, features=features)


def _engine(state: ServerState, **changes: Any) -> None:
    if state.served is not None:
        state.served.engine.reconfigure(**changes)


def _loop_detection(state: ServerState, value: str | None) -> None:
    from mlxcel.chat.loop_guard import parse_operator_override

    _features(state, loop_operator=parse_operator_override(value))


def sampling_defaults(values: Mapping[str, Any], checkpoint: Mapping[str, Any] | None = None) -> SamplingDefaults:
    """The sampling defaults: the settings `default_<field>` (--temp, --top-k, ...) over the checkpoint's own."""
    return SamplingDefaults(**{name: values.get(f"default_{name}") for name in SAMPLING_DEFAULTS},
                            checkpoint=dict(checkpoint or {}))


def _sampling(name: str, state: ServerState, value: Any) -> None:
    """Swap one sampling default; the next request reads it, requests already built keep theirs."""
    if state.api is not None:
        state.api = replace(state.api, sampling=replace(state.api.sampling, **{name: value}))


def _verbose(state: ServerState, value: bool) -> None:
    logging.getLogger().setLevel(logging.DEBUG if value else logging.INFO)


APPLIERS: dict[str, Applier] = {
    "reasoning_budget": lambda state, value: _features(state, reasoning_budget=value),
    "loop_detection": _loop_detection,
    "max_queue_depth": lambda state, value: _engine(state, max_queue_depth=value),
    "decode_timeout": lambda state, value: _engine(state, decode_timeout_s=value),
    "default_n_predict": lambda state, value: _engine(state, n_predict=value),  # sampling defaults (-n, -s)
    "default_seed": lambda state, value: _engine(state, seed=value),
    "verbose": _verbose,
    **{f"default_{name}": partial(_sampling, name) for name in SAMPLING_DEFAULTS},  # --temp, --top-k, ...
}
