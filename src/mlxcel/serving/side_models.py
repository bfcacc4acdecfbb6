"""What one server process serves besides (or instead of) the chat model (spec I, A6, A7).

`plan_process` reads the model arguments: `-m` given an embedding checkpoint makes an
embedding-only process, a 1-label `*ForSequenceClassification` checkpoint a rerank-only
one; `--embedding-model` / `--reranker-model` add a provider beside the chat model. A
causal LM becomes a generative reranker only when named by `--reranker-model`; the same
path as `-m` selects a rerank-only process and loads the model once. `--embeddings` and
`--reranking` are llama-server's restricted modes: chat is not served and the matching
provider must exist. `load_side_models` then loads each provider on its own worker thread.
A Florence-2 checkpoint as `-m` (spec T) is a process of its own: `find_florence2` tells it
and `load_florence2` starts its single-stream seq2seq worker, which answers
/v1/chat/completions (the other text routes answer 501).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mlxcel.api.modes import SinglePurposeMode
from mlxcel.loading import ModelLoadError, ResolvedModel, load_model
from mlxcel.loading.packaged import is_packaged_name, resolve_packaged
from mlxcel.loading.encoder import is_embedding_checkpoint, is_rerank_checkpoint
from mlxcel.serving.process import NamedProvider, SideModels  # the products; re-exported for callers of this module
from mlxcel.serving.served_model import load_tokenizer  # the chat model's tokenizer path (GGUF or HF folder)
from mlxcel.workers.base import WorkerConfig
from mlxcel.workers.causal_lm import last_position_logits
from mlxcel.workers.embedding import (
    EmbeddingConfig,
    EmbeddingProvider,
    PoolingType,
)
from mlxcel.workers.encoder_inputs import parse_dtype
from mlxcel.workers.florence2 import Florence2Config, Florence2Provider, is_florence2_checkpoint


from mlxcel.workers.image import ImageConfig, ImageGenerator, is_image_checkpoint
from mlxcel.workers.rerank import (
    GenerativeReranker,
    RerankConfig,
    RerankProvider,
    rerank_batch_size,
)

log = logging.getLogger(__name__)

Resolve = Callable[[str | None], ResolvedModel]


class CheckpointKind(enum.Enum):
    CHAT = "chat"  # a causal LM (or anything that is not one of the two below)
    EMBEDDING = "embedding"
    CROSS_ENCODER = "cross-encoder"


@dataclass(frozen=True, slots=True)
class SideModelOptions:
    """The embedding and rerank flags, validated (spec I)."""

    embedding_model: str | None = None  # --embedding-model
    reranker_model: str | None = None  # --reranker-model
    embedding: EmbeddingConfig = EmbeddingConfig()
    rerank: RerankConfig = RerankConfig()
    is_embeddings_mode: bool = False  # --embedding / --embeddings
    is_reranking_mode: bool = False  # --rerank / --reranking


@dataclass(frozen=True, slots=True)
class ProcessPlan:
    """Which checkpoints to load, and for what; built before anything is loaded."""

    chat: ResolvedModel | None  # served on the chat routes; None = single-purpose process
    embedding: ResolvedModel | None = None
    reranker: ResolvedModel | None = None
    reranker_kind: CheckpointKind | None = None  # CROSS_ENCODER or CHAT (generative)
    mode: SinglePurposeMode | None = None  # set exactly when chat is None


def side_model_options(
    *, embedding_model: str | None = None, reranker_model: str | None = None, pooling: str | None = None,
    embd_normalize: int | None = None, embedding_batch_size: int = 16, rerank_batch_size_flag: int = 0,
    queue_depth: int = 8, request_timeout_s: float = 120.0, is_embeddings_mode: bool = False,
    is_reranking_mode: bool = False, device: str = "cpu", dtype: str = "float32",
) -> SideModelOptions:
    """Validate the flag values into options; a ValueError names the flag."""
    _require(embedding_batch_size >= 1, f"--embedding-batch-size must be at least 1, not {embedding_batch_size}")
    _require(queue_depth >= 1, f"--embedding-queue-depth must be at least 1, not {queue_depth}")
    _require(request_timeout_s > 0, f"--embedding-request-timeout-secs must be positive, not {request_timeout_s}")
    worker = WorkerConfig(queue_depth, embedding_batch_size, request_timeout_s)
    rerank_worker = replace(worker, batch_size=rerank_batch_size(rerank_batch_size_flag))
    return SideModelOptions(
        embedding_model=embedding_model, reranker_model=reranker_model,
        embedding=EmbeddingConfig(PoolingType(pooling) if pooling else None, embd_normalize, device, dtype, worker),
        rerank=RerankConfig(device, dtype, rerank_worker),
        is_embeddings_mode=is_embeddings_mode, is_reranking_mode=is_reranking_mode)


@dataclass(frozen=True, slots=True)
class ImageOptions:
    """The image-generation flags, validated (spec J)."""

    model: str  # --image-model
    config: ImageConfig = ImageConfig()


def image_options(model: str, queue_depth: int = 4, request_timeout_s: float = 300.0, *, device: str = "cpu",
                  dtype: str = "float32") -> ImageOptions:
    """One job at a time (batch size 1): a diffusion run holds the accelerator for seconds (spec J)."""
    _require(queue_depth >= 1, f"--image-queue-depth must be at least 1, not {queue_depth}")
    _require(request_timeout_s > 0, f"--image-request-timeout-secs must be positive, not {request_timeout_s}")
    return ImageOptions(model, ImageConfig(device, dtype, WorkerConfig(queue_depth, 1, request_timeout_s)))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def resolve_side_model(arg: str | None, resolve: Resolve) -> ResolvedModel:
    """A packaged checkpoint name (all-minilm-l6-v2) or anything `resolve_model` takes."""
    if arg and is_packaged_name(arg) and not Path(arg).exists():
        return ResolvedModel(resolve_packaged(arg), arg, f"packaged checkpoint {arg}")
    return resolve(arg)


def checkpoint_kind(path: Path) -> CheckpointKind:
    """Embedding or cross-encoder folders by their config; everything else is a chat model."""
    if not path.is_dir():
        return CheckpointKind.CHAT  # a GGUF file
    if is_rerank_checkpoint(path):
        return CheckpointKind.CROSS_ENCODER
    if is_embedding_checkpoint(path):
        return CheckpointKind.EMBEDDING
    return CheckpointKind.CHAT


# ---- planning ----

def plan_process(model_arg: str | None, options: SideModelOptions, resolve: Resolve) -> ProcessPlan:
    """Decide what to load from -m, --embedding-model, --reranker-model and the restricted modes.

    Raises ValueError naming the flags when they contradict each other.
    """
    main = resolve_side_model(model_arg, resolve)
    embedding = resolve_side_model(options.embedding_model, resolve) if options.embedding_model else None
    reranker = resolve_side_model(options.reranker_model, resolve) if options.reranker_model else None
    _check_embedding_flag(embedding)
    main_kind = checkpoint_kind(main.path)
    chat: ResolvedModel | None = None
    if main_kind is CheckpointKind.EMBEDDING:
        embedding = _only_one(main, embedding, "--embedding-model", "embedding")
    elif main_kind is CheckpointKind.CROSS_ENCODER:
        reranker = _only_one(main, reranker, "--reranker-model", "rerank")
    elif reranker is None or not _is_same(main, reranker):
        chat = main
    chat = _apply_restricted_modes(chat, model_arg, embedding, reranker, options)
    reranker_kind = _reranker_kind(reranker)
    mode = None if chat is not None else _single_purpose_mode(main_kind, embedding, reranker, options)
    return ProcessPlan(chat, embedding, reranker, reranker_kind, mode)


def _check_embedding_flag(embedding: ResolvedModel | None) -> None:
    if embedding is not None and checkpoint_kind(embedding.path) is not CheckpointKind.EMBEDDING:
        raise ValueError(f"--embedding-model {embedding.name}: not an embedding checkpoint (a sentence-transformers "
                         "folder or a bare encoder such as BertModel)")


def _only_one(main: ResolvedModel, flag_model: ResolvedModel | None, flag: str, what: str) -> ResolvedModel:
    # One provider of each kind per process (spec I).
    if flag_model is not None and not _is_same(main, flag_model):
        raise ValueError(f"-m {main.name} is already the {what} model and one process serves one {what} "
                         f"provider; drop {flag} {flag_model.name} or give -m a chat model")
    return main


def _is_same(a: ResolvedModel, b: ResolvedModel) -> bool:
    return a.path.resolve() == b.path.resolve()


def _apply_restricted_modes(chat: ResolvedModel | None, model_arg: str | None, embedding: ResolvedModel | None,
                            reranker: ResolvedModel | None, options: SideModelOptions) -> ResolvedModel | None:
    flags = _restricted_flags(options)
    if options.is_embeddings_mode and embedding is None:
        raise ValueError("--embeddings serves embeddings only and needs an embedding model: pass "
                         "--embedding-model MODEL or an embedding checkpoint as -m")
    if options.is_reranking_mode and reranker is None:
        raise ValueError("--reranking serves reranking only and needs a reranker: pass --reranker-model MODEL "
                         "or a 1-label sequence-classification checkpoint as -m")
    if not flags or chat is None:
        return chat
    if model_arg:  # an explicit chat model that the restricted mode would leave unused
        raise ValueError(f"-m {chat.name} is a chat model, but {' and '.join(flags)} serve no chat; "
                         f"drop -m or {flags[0]}")
    return None  # the default chat model is simply not loaded


def _restricted_flags(options: SideModelOptions) -> list[str]:
    return [flag for flag, is_on in (("--embeddings", options.is_embeddings_mode),
                                     ("--reranking", options.is_reranking_mode)) if is_on]


def _reranker_kind(reranker: ResolvedModel | None) -> CheckpointKind | None:
    if reranker is None:
        return None
    kind = checkpoint_kind(reranker.path)
    if kind is CheckpointKind.EMBEDDING:
        raise ValueError(f"--reranker-model {reranker.name}: an embedding checkpoint cannot rerank; pass a 1-label "
                         "sequence-classification checkpoint or a causal LM (generative reranker)")
    return kind


def _single_purpose_mode(main_kind: CheckpointKind, embedding: ResolvedModel | None,
                         reranker: ResolvedModel | None, options: SideModelOptions) -> SinglePurposeMode:
    name = {(True, False): "embedding-only", (False, True): "rerank-only"}.get(
        (embedding is not None, reranker is not None), "embedding-and-rerank-only")
    flags = _restricted_flags(options)
    if flags:
        return SinglePurposeMode(name, flags[0], f"To serve chat, start it without {' and '.join(flags)} "
                                 "and with -m CHAT_MODEL.")
    if main_kind is CheckpointKind.EMBEDDING:
        return SinglePurposeMode(name, "--embedding-model", "To serve chat as well, start it with -m CHAT_MODEL "
                                 "--embedding-model EMBEDDING_MODEL.")
    if main_kind is CheckpointKind.CROSS_ENCODER:
        return SinglePurposeMode(name, "--reranker-model", "To serve chat as well, start it with -m CHAT_MODEL "
                                 "--reranker-model RERANKER_MODEL.")
    return SinglePurposeMode(name, "--reranker-model", "-m and --reranker-model name the same model, which selects "
                             "a generative rerank-only process; to serve chat as well, start it with "
                             "-m CHAT_MODEL --reranker-model RERANKER_MODEL.")


# ---- loading ----

def load_side_models(plan: ProcessPlan, options: SideModelOptions, created: int) -> SideModels:
    """Load each planned provider and start its worker thread; stops what started if one fails."""
    side = SideModels(mode=plan.mode)
    try:
        if plan.embedding is not None:
            _load_embedding(side, plan.embedding, options.embedding, created)
        if plan.reranker is not None:
            _load_reranker(side, plan, options.rerank, created)
    except BaseException:
        side.stop(10.0)
        raise
    return side


def _load_embedding(side: SideModels, resolved: ResolvedModel, config: EmbeddingConfig, created: int) -> None:
    provider = EmbeddingProvider.load(resolved.path, config)
    side.embedding = provider
    side.embedding_info = NamedProvider(resolved.name, provider.model.window, created)
    side.stoppers.append(("embedding", provider.stop))
    log.info("embedding model: %s (%s, %d dims, pooling %s, window %d tokens)", resolved.name, resolved.source,
             provider.model.dim, provider.pooling.value, provider.model.window)


def _load_reranker(side: SideModels, plan: ProcessPlan, config: RerankConfig, created: int) -> None:
    resolved = plan.reranker
    assert resolved is not None
    if plan.reranker_kind is CheckpointKind.CROSS_ENCODER:
        provider: RerankProvider | GenerativeReranker = RerankProvider.load(resolved.path, config)
        window, kind = provider.model.window, "cross-encoder"
    else:
        provider = load_generative_reranker(resolved.path, config)
        window, kind = provider.window, "generative yes/no"
    side.reranker = provider
    side.reranker_info = NamedProvider(resolved.name, window, created)
    side.stoppers.append(("rerank", provider.stop))
    log.info("reranker: %s (%s, %s, window %d tokens)", resolved.name, resolved.source, kind, window)


# ---- Florence-2 (spec T) ----

def find_florence2(model_arg: str | None, resolve: Resolve) -> ResolvedModel | None:
    """The Florence-2 checkpoint `-m` names, or None when it names something else."""
    if not model_arg:
        return None
    try:
        resolved = resolve_side_model(model_arg, resolve)
    except ModelLoadError:
        return None  # the chat loader reports it with its own message
    return resolved if is_florence2_checkpoint(resolved.path) else None


def florence2_mode() -> SinglePurposeMode:
    return SinglePurposeMode(
        "florence2", "-m", "To serve chat, start another process with -m CHAT_MODEL; a Florence-2 checkpoint is "
        "served in its own process.", serves="Florence-2 vision tasks on /v1/chat/completions (one user message: "
        "a task prompt such as <OD> and one image_url part)")


def load_florence2(resolved: ResolvedModel, config: Florence2Config, created: int) -> SideModels:
    """Load the model and processor and start the worker thread that alone runs them."""
    provider = Florence2Provider.load(resolved.path, config)
    log.info("Florence-2 model: %s (%s, %s on %s, single-stream worker, %d waiting at most, %g s per request)",
             resolved.name, resolved.source, str(config.dtype).removeprefix("torch."), config.device,
             config.max_queue_depth, config.request_timeout_s)
    return SideModels(mode=florence2_mode(), florence2=provider,
                      florence2_info=NamedProvider(resolved.name, provider.window, created),
                      stoppers=[("florence2", provider.stop)])


def load_image_model(side: SideModels, options: ImageOptions, resolve: Resolve, created: int,
                     name: str | None = None) -> None:
    """The --image-model pipeline on its own worker thread, beside whatever else `side` holds (spec J).

    `name` is the id it is listed under (an image-only process's --alias); by default the
    checkpoint's folder name. Any failure is a ModelLoadError: a fatal startup error.
    """
    resolved = resolve(options.model)
    if not is_image_checkpoint(resolved.path):
        raise ModelLoadError(f"--image-model {options.model}: {resolved.path} is not a diffusers pipeline folder "
                             "(no model_index.json)")
    generator = ImageGenerator.load(resolved.path, options.config)
    side.image = generator
    side.image_info = NamedProvider(name or resolved.name, 0, created)
    side.stoppers.append(("image", generator.stop))
    width, height = generator.default_size()
    log.info("image model: %s (%s, %s, %dx%d by default, edits %s, one job at a time, queue %d)",
             side.image_info.name, resolved.source, generator.family, width, height,
             "on" if generator.supports_edits else "off", options.config.worker.queue_depth)


def load_generative_reranker(path: Path, config: RerankConfig) -> GenerativeReranker:
    """A causal LM scored by its yes/no logits; its worker thread is the model's only user."""
    loaded = load_model(path, device=config.device, dtype=parse_dtype(config.dtype))
    tokenizer = load_tokenizer(loaded)
    model, device = loaded.model, config.device

    def logits_fn(token_lists: list[list[int]]) -> torch.Tensor:
        return last_position_logits(model, token_lists, device)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    window = int(loaded.model.args.max_position_embeddings)
    reranker = GenerativeReranker(logits_fn, encode, window, worker=config.worker)
    reranker.start()
    return reranker


