"""The one startup path (A1, A6): builds the process from the settings and hands the server one object.

`run(settings)` is `mlxcel serve` in A6 order: logging, the API key, then `build_process`
(what this process serves, spec I/G/H: the chat model with its template, weights, decode path,
engine and warmup; side workers; or an audio-only / realtime process), bind the socket, then
`server_state(process, settings)`: the `ServerState` with the live settings (F9), the realtime
service (H) and the web UI's model control (A5), whose run-time loads go through `ModelLoader`,
this same path. It runs in the API process; the chat model's engine runs here or in the engine
process (`serving.chat_model`, `serving.engine_process`). It sits above `serving/`, `server/` and
`command_line` (issue 47): it assembles their products, so `serving/` stays a layer `server/` builds
on. `server/` never imports the loaders (`serving.served_model`, `.chat_model`, `.engine_process`,
`.side_models`, `.audio_models`, `workers`); it holds what this module built (`mlxcel.serving.process`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mlxcel.serving.process import Process, SideModels, Stopper

if TYPE_CHECKING:
    from mlxcel.api.realtime import RealtimeService
    from mlxcel.serving.audio_models import AudioOptions
    from mlxcel.command_line import ServeSettings
    from mlxcel.config import EngineConfig
    from mlxcel.loading import ResolvedModel
    from mlxcel.serving.served_model import RuntimeOptions, ServedModel
    from mlxcel.server.lifecycle import Worker
    from mlxcel.server.state import ServerState
    from mlxcel.serving.side_models import ProcessPlan, SideModelOptions

log = logging.getLogger("mlxcel")
Resolve = Callable[[str | None], "ResolvedModel"]


def run(settings: ServeSettings) -> int:
    """A6 in order: logging, API key, template + weights + engine + warmup, bind; then serve (A7)."""
    from mlxcel.command_line import configure_logging
    from mlxcel.loading import ModelLoadError
    from mlxcel.server.lifecycle import Worker, bind_socket, serve

    configure_logging(settings.verbose, settings.log_file)
    log.info("API key authentication: %s", f"on ({settings.api_key_source})" if settings.server.api_keys else "off")
    from mlxcel.command_line import draft_refusal
    from mlxcel.serving.served_model import DraftMismatchError, MemoryBudgetError

    if (refusal := draft_refusal(settings.engine.speculative)) is not None:
        log.error("cannot start: %s", refusal)
        return 2
    from mlxcel.layers.lora import AdapterError

    try:
        process = build_process(settings)
    except AdapterError as exc:  # F8: an adapter that does not fit the model is a usage error
        log.error("cannot start: LoRA adapter %s", exc)
        return 2
    except (DraftMismatchError, MemoryBudgetError) as exc:  # B1, B3: a drafter that cannot draft; O: no block fits
        log.error("cannot start: %s", exc)
        return 2
    except (ModelLoadError, ValueError, OSError) as exc:
        log.error("cannot start: %s", exc)
        return 1
    try:
        sock = bind_socket(settings.server)
    except OSError as exc:
        log.error("cannot listen: %s", exc)
        for name, stop in process.stoppers():
            Worker(name, stop).stop(10.0)
        return 1
    state, workers = server_state(process, settings)
    _leave_now(serve(state, sock, workers))
    return 1  # not reached


def _leave_now(code: int) -> None:
    """End the server process once serve() returned: every worker is joined and the engine stopped, so the
    interpreter's teardown (torch's and the kernels' destructors: 3-6 s on the 2-core CPU machine) only
    delays the exit a supervisor waits for after SIGTERM (issue 44). Logs and stdio are flushed first."""
    import os

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def server_state(process: Process, settings: ServeSettings) -> tuple[ServerState, list[Worker]]:
    """The one object the app holds, and the workers shutdown joins (A7)."""
    from mlxcel.server.lifecycle import Worker
    from mlxcel.server.state import ServerState

    state = ServerState(settings.server, process.served, side=process.side, media=settings.media,
                        settings=process.values)
    if process.side.realtime is not None:
        state.realtime = _realtime_service(state, process.side)
    if settings.server.webui:  # A5: the served models change at run time; shutdown stops whatever is loaded
        return state, [Worker("models", _attach_control(state, settings))]
    return state, [Worker(name, stop) for name, stop in process.stoppers()]


# ---- what one process serves ----

def build_process(settings: ServeSettings) -> Process:
    """The chat model (unless single-purpose), then the embedding and rerank providers beside it (spec I)."""
    from mlxcel.serving.side_models import SideModelOptions, load_side_models, plan_process

    resolve = _resolver(settings.models_dir, settings.default_org)
    if settings.realtime_stt or settings.realtime_tts:
        return Process(*_start_realtime_process(settings, resolve), values=settings.values)
    if settings.image is not None and not settings.model:
        return Process(None, _start_image_process(settings), settings.values)
    audio = _start_audio_process(settings, resolve)
    if audio is not None:
        return Process(None, audio, settings.values)
    florence2 = _start_florence2_process(settings, resolve)
    if florence2 is not None:
        return Process(None, florence2, settings.values)
    options = settings.side or SideModelOptions()
    if settings.server.webui and not settings.model:  # A5: model-less start; the UI loads one
        plan = _model_less_plan(options, resolve)
        log.info("web UI: starting without a chat model (chat routes answer 503 until one is loaded)")
    else:
        plan = plan_process(settings.model, options, resolve)
    served = None
    if plan.chat is not None:
        log.info("model: %s (%s)", plan.chat.name, plan.chat.source)
        spec = settings.engine.speculative
        draft = resolve(spec.draft_model) if spec.draft_kind == "full-model" and spec.draft_model else None
        served = start_chat_model(plan.chat, settings.runtime, settings.engine, draft)
    elif plan.mode is not None:
        log.info("%s process: no chat model is served (chat routes answer 501)", plan.mode.name)
    try:
        side = load_side_models(plan, options, int(time.time()))
        _add_image_model(side, settings)
        return Process(served, side, settings.values)
    except BaseException:
        if served is not None:
            served.close()
        raise


def start_chat_model(resolved: ResolvedModel, runtime: RuntimeOptions, engine: EngineConfig,
                     draft: ResolvedModel | None = None) -> ServedModel:
    """A6 for the chat model: template, weights (logging the materialization), decode path, engine, warmup;
    with `draft`, the draft model of full-model speculative decoding (B1) beside it."""
    from mlxcel.serving.chat_model import start_served_model

    return start_served_model(resolved, runtime, engine, draft=draft)


def _resolver(models_dir: Path | None, default_org: str, *, allow_download: bool = True) -> Resolve:
    from mlxcel.loading import resolve_model

    def resolve(arg: str | None) -> ResolvedModel:
        return resolve_model(arg, models_dir=models_dir, default_org=default_org, allow_download=allow_download)

    return resolve


def _model_less_plan(options: SideModelOptions, resolve: Resolve) -> ProcessPlan:
    """--webui without -m: no chat model (not even the default is looked for), side models as flagged."""
    from mlxcel.serving.side_models import ProcessPlan, checkpoint_kind, resolve_side_model

    embedding = resolve_side_model(options.embedding_model, resolve) if options.embedding_model else None
    reranker = resolve_side_model(options.reranker_model, resolve) if options.reranker_model else None
    return ProcessPlan(None, embedding, reranker, checkpoint_kind(reranker.path) if reranker else None)


def _start_audio_process(settings: ServeSettings, resolve: Resolve) -> SideModels | None:
    """An audio-only process when -m names a Whisper, Kokoro or Piper checkpoint (spec G)."""
    from mlxcel.serving.audio_models import AudioOptions, audio_only_mode, find_audio_checkpoint, load_audio_models

    found = find_audio_checkpoint(settings.model, resolve)
    if found is None:
        return None
    _refuse_side_flags(settings)
    audio = load_audio_models(found, settings.audio or AudioOptions(), int(time.time()))
    log.info("audio-only process: %s (chat routes answer 501)", audio_only_mode(audio.kind).serves)
    return SideModels(mode=audio_only_mode(audio.kind), audio=audio, stoppers=list(audio.stoppers))


def _start_florence2_process(settings: ServeSettings, resolve: Resolve) -> SideModels | None:
    """A Florence-2 process when -m names a Florence-2 checkpoint (spec T): its single-stream worker,
    bounded by --max-queue-depth, each request by --decode-timeout."""
    from mlxcel.serving.side_models import find_florence2, load_florence2
    from mlxcel.workers.florence2 import Florence2Config

    found = find_florence2(settings.model, resolve)
    if found is None:
        return None
    _refuse_side_flags(settings, "a Florence-2 checkpoint, served in its own process")
    if settings.runtime.adapters:
        raise ValueError(f"-m {settings.model} is a Florence-2 checkpoint; --lora adapters apply to chat models only")
    engine = settings.engine
    config = Florence2Config(settings.runtime.device, settings.runtime.torch_dtype(), engine.max_queue_depth,
                             engine.decode_timeout_s)
    side = load_florence2(found, config, int(time.time()))
    log.info("Florence-2 process: vision tasks on /v1/chat/completions (other text routes answer 501)")
    return side


def _add_image_model(side: SideModels, settings: ServeSettings, name: str | None = None) -> None:
    """--image-model beside the other models (spec J); a load failure stops what started and is fatal."""
    from mlxcel.serving.side_models import load_image_model

    if settings.image is None:
        return
    try:
        load_image_model(side, settings.image, _image_resolver(settings), int(time.time()), name)
    except BaseException:
        side.stop(10.0)
        raise


def _image_resolver(settings: ServeSettings) -> Resolve:
    from mlxcel.loading.resolve import resolve_folder

    def resolve(arg: str | None) -> ResolvedModel:
        assert arg
        return resolve_folder(arg, models_dir=settings.models_dir)

    return resolve


# the flags the spec lists as incompatible with an image-only process (no --models-preset here)
_IMAGE_ONLY_CONFLICTS = (("--models-dir", "models_dir"), ("--webui", "webui"),
                         ("--embedding-model", "embedding_model"), ("--reranker-model", "reranker_model"),
                         ("--embeddings", "embeddings_mode"), ("--reranking", "reranking_mode"))


def _start_image_process(settings: ServeSettings) -> SideModels:
    """--image-model without -m: the pipeline is the served model, listed as --alias's first name (spec J)."""
    from mlxcel.api.modes import SinglePurposeMode

    conflicts = [flag for flag, name in _IMAGE_ONLY_CONFLICTS if settings.values.get(name)]
    if conflicts:
        raise ValueError(f"--image-model without -m starts an image-only process, which cannot take "
                         f"{conflicts[0]}; drop {conflicts[0]} or give -m a chat model to serve beside the images")
    side = SideModels(mode=SinglePurposeMode(
        "image-only", "--image-model", "It was started with --image-model and no -m; to serve chat as well, "
        "start it with -m CHAT_MODEL --image-model IMAGE_MODEL.", serves="image generation"))
    aliases = settings.server.aliases
    _add_image_model(side, settings, aliases[0] if aliases else None)
    log.info("image-only process: no chat model is served (chat routes answer 501)")
    return side


def _start_realtime_process(settings: ServeSettings, resolve: Resolve) -> tuple[ServedModel, SideModels]:
    """-m the chat model, --realtime-stt / --realtime-tts its ears and voice: /v1/realtime only (spec H)."""
    from mlxcel.api.modes import ModelEntry, SinglePurposeMode
    from mlxcel.serving.audio_models import AudioOptions, find_audio_checkpoint, load_audio_models
    from mlxcel.workers.audio_checkpoints import AudioKind

    if not (settings.realtime_stt and settings.realtime_tts):
        raise ValueError("--realtime-stt and --realtime-tts go together: the voice session needs both")
    _refuse_side_flags(settings)
    stt = find_audio_checkpoint(settings.realtime_stt, resolve)
    tts = find_audio_checkpoint(settings.realtime_tts, resolve)
    if stt is None or stt.checkpoint.kind is not AudioKind.WHISPER:
        raise ValueError(f"--realtime-stt {settings.realtime_stt}: not a Whisper checkpoint")
    if tts is None or tts.checkpoint.kind is AudioKind.WHISPER:
        raise ValueError(f"--realtime-tts {settings.realtime_tts}: not a Kokoro or Piper checkpoint")
    options: AudioOptions = settings.audio or AudioOptions()
    created = int(time.time())
    chat = resolve(settings.model)
    if find_audio_checkpoint(settings.model, resolve) is not None:
        raise ValueError(f"-m {settings.model}: the realtime cascade needs a chat model as -m")
    side = SideModels(mode=SinglePurposeMode(
        "realtime", "--realtime-stt", "Connect a WebSocket client to /v1/realtime; to serve the chat routes, start "
        "without --realtime-stt / --realtime-tts.", serves="a full-duplex voice session on the /v1/realtime "
        "WebSocket"))
    try:
        ears = load_audio_models(stt, options, created)
        side.stoppers.extend(ears.stoppers)
        voice = load_audio_models(tts, options, created)
        side.stoppers.extend(voice.stoppers)
        side.realtime = (ears, voice)
        side.realtime_entry = ModelEntry(chat.name, ("realtime",), created, 0)
        log.info("model: %s (%s), realtime cascade: %s -> chat -> %s", chat.name, chat.source, stt.name, tts.name)
        return start_chat_model(chat, settings.runtime, settings.engine), side
    except BaseException:
        side.stop(10.0)
        raise


def _refuse_side_flags(settings: ServeSettings,
                       what: str = "an audio checkpoint, served in an audio-only process") -> None:
    side = settings.side
    if side is None:
        return
    flags = [flag for flag, is_set in (("--embedding-model", side.embedding_model), ("--reranker-model",
             side.reranker_model), ("--embeddings", side.is_embeddings_mode), ("--reranking",
             side.is_reranking_mode), ("--image-model", settings.image is not None)) if is_set]
    if flags:
        raise ValueError(f"-m {settings.model} is {what}; drop {' and '.join(flags)} or give -m a chat model")


# ---- services built on the state ----

def _attach_control(state: ServerState, settings: ServeSettings) -> Stopper:
    from mlxcel.server.model_control import ModelControl

    loader = ModelLoader(settings.runtime, settings.engine, settings.models_dir, settings.default_org, settings.side)
    state.control = ModelControl(state, loader)
    key = settings.server.ui_session_key
    if key is not None:  # the terminal only: never into --log-file
        sys.stderr.write(f"mlxcel web UI session key (enter it at /webui/; valid until this server stops): {key}\n")
        sys.stderr.flush()
    return state.control.stop


def _realtime_service(state: ServerState, side: SideModels) -> RealtimeService:
    from mlxcel.api.realtime import RealtimeService
    from mlxcel.api.realtime_cascade import CascadeEngine

    assert side.realtime is not None and state.api is not None
    stt, tts = side.realtime
    assert stt.transcriber is not None and tts.synthesizer is not None
    return RealtimeService(CascadeEngine(stt.transcriber, state.api, tts.synthesizer), state.api.model_name)


# ---- run-time loads (A5) ----

@dataclass(frozen=True)
class ModelLoader:
    """How the web UI loads models at run time: the startup model's options, through this module's path."""

    runtime: RuntimeOptions
    engine: EngineConfig
    models_dir: Path | None = None
    default_org: str = "mlx-community"
    side: SideModelOptions | None = None

    @property
    def device(self) -> str:
        return self.runtime.device

    def resolve(self, model_id: str) -> ResolvedModel:
        """A catalog id: "" (the embedded default), a packaged name, a path, or a repo id in the store."""
        from mlxcel.serving.side_models import resolve_side_model

        in_store = self.models_dir / model_id if self.models_dir and model_id else None
        if in_store is not None and "/" not in model_id and in_store.exists():  # a folder or file of the store
            model_id = str(in_store)
        # downloads are their own job, with progress
        return resolve_side_model(model_id or None, _resolver(self.models_dir, self.default_org, allow_download=False))

    def load_chat(self, resolved: ResolvedModel) -> ServedModel:
        return start_chat_model(resolved, self.runtime, self.engine)

    def load_side(self, role: str, resolved: ResolvedModel) -> SideModels:
        """One embedding or rerank provider on its own worker thread, as startup loads it (spec I)."""
        from mlxcel.serving.side_models import ProcessPlan, SideModelOptions, checkpoint_kind, load_side_models

        is_rerank = role == "rerank"
        plan = ProcessPlan(None, embedding=None if is_rerank else resolved, reranker=resolved if is_rerank else None,
                           reranker_kind=checkpoint_kind(resolved.path) if is_rerank else None)
        return load_side_models(plan, self.side or SideModelOptions(), int(time.time()))
