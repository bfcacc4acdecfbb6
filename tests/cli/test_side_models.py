"""What a process serves (spec I) and the media flags (C2-C5): `plan_process` over real
checkpoint folders and the real SmolLM2 GGUF path (nothing is loaded), and the CLI flags with
their environment mirrors."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxcel.command_line import OPTIONS, resolve_values, serve_parser, serve_settings
from mlxcel.env import Environment
from mlxcel.loading import resolve_model
from mlxcel.media import MediaConfigError
from mlxcel.serving.side_models import CheckpointKind, ProcessPlan, SideModelOptions, plan_process, side_model_options
from mlxcel.workers.embedding import PoolingType
from tests.workers.tiny_checkpoints import write_sentence_transformers_files, write_tiny_bert


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("checkpoints")
    embedding = write_tiny_bert(root / "embedding")
    write_sentence_transformers_files(embedding, {"pooling_mode": "mean"})
    return {"embedding": str(embedding), "other_embedding": str(write_tiny_bert(root / "bare")),
            "cross": str(write_tiny_bert(root / "cross", classifier=True)), "gguf": str(resolve_model(None).path)}


def plan(model: str | None = None, **options: object) -> ProcessPlan:
    return plan_process(model, side_model_options(**options), resolve_model)  # type: ignore[arg-type]


def test_i_embedding_checkpoint_as_m_is_embedding_only(folders: dict[str, str]) -> None:
    result = plan(folders["embedding"])
    assert result.chat is None and result.embedding is not None and result.reranker is None
    assert result.mode is not None and (result.mode.name, result.mode.flag) == ("embedding-only", "--embedding-model")


def test_i_cross_encoder_as_m_is_rerank_only(folders: dict[str, str]) -> None:
    result = plan(folders["cross"])
    assert result.chat is None and result.reranker_kind is CheckpointKind.CROSS_ENCODER
    assert result.mode is not None and (result.mode.name, result.mode.flag) == ("rerank-only", "--reranker-model")


def test_i_embedding_as_m_with_a_reranker_serves_both_without_chat(folders: dict[str, str]) -> None:
    result = plan(folders["embedding"], reranker_model=folders["cross"])
    assert result.chat is None and result.mode is not None and result.mode.name == "embedding-and-rerank-only"


def test_i_providers_beside_the_default_chat_model(folders: dict[str, str]) -> None:
    result = plan(embedding_model=folders["embedding"], reranker_model=folders["cross"])
    assert result.chat is not None and result.chat.path == Path(folders["gguf"]) and result.mode is None
    assert result.embedding is not None and result.reranker_kind is CheckpointKind.CROSS_ENCODER


def test_i_generative_reranker_only_when_chosen_and_loaded_once(folders: dict[str, str]) -> None:
    beside = plan(reranker_model=folders["gguf"], embedding_model=folders["embedding"])
    assert beside.chat is None  # the default chat model's own path: rerank-only, one load
    same = plan(folders["gguf"], reranker_model=folders["gguf"])
    assert same.chat is None and same.reranker_kind is CheckpointKind.CHAT
    assert same.mode is not None and (same.mode.name, same.mode.flag) == ("rerank-only", "--reranker-model")
    assert plan(folders["gguf"]).reranker is None  # a causal LM never becomes a reranker by itself


def test_i_restricted_modes(folders: dict[str, str]) -> None:
    embeddings = plan(embedding_model=folders["embedding"], is_embeddings_mode=True)
    assert embeddings.chat is None and embeddings.mode is not None and embeddings.mode.flag == "--embeddings"
    reranking = plan(folders["cross"], is_reranking_mode=True)
    assert reranking.mode is not None and reranking.mode.flag == "--reranking"


@pytest.mark.parametrize(("model", "options", "words"), [
    (None, {"is_embeddings_mode": True}, "--embeddings serves embeddings only and needs an embedding model"),
    (None, {"is_reranking_mode": True}, "--reranking serves reranking only and needs a reranker"),
    ("gguf", {"is_embeddings_mode": True, "embedding_model": "embedding"}, "is a chat model, but --embeddings"),
    ("embedding", {"embedding_model": "other_embedding"}, "one process serves one embedding provider"),
    ("cross", {"reranker_model": "gguf"}, "one process serves one rerank provider"),
    (None, {"embedding_model": "cross"}, "not an embedding checkpoint"),
    (None, {"reranker_model": "embedding"}, "an embedding checkpoint cannot rerank"),
])
def test_i_contradicting_flags_name_them(folders: dict[str, str], model: str | None, options: dict[str, object],
                                         words: str) -> None:
    named = {key: folders.get(value, value) if isinstance(value, str) else value for key, value in options.items()}
    with pytest.raises(ValueError, match=words):
        plan(folders[model] if model else None, **named)


def test_i_option_validation_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--embedding-queue-depth"):
        side_model_options(queue_depth=0)
    with pytest.raises(ValueError, match="--embedding-request-timeout-secs"):
        side_model_options(request_timeout_s=0)
    with pytest.raises(ValueError, match="--rerank-batch-size"):
        side_model_options(rerank_batch_size_flag=-1)


def settings(argv: list[str], env: dict[str, str] | None = None):  # noqa: ANN201 - ServeSettings
    environment = Environment.read(env or {})
    namespace = serve_parser("mlxcel-server", "server").parse_args(argv)
    return serve_settings(resolve_values(namespace, OPTIONS, environment), environment)


def test_i_flags_and_llama_arg_mirrors() -> None:
    side = settings([]).side
    assert isinstance(side, SideModelOptions) and side.embedding.worker.batch_size == 16
    assert (side.rerank.worker.batch_size, side.embedding.worker.queue_depth) == (8, 8)
    assert side.embedding.worker.request_timeout_s == 120.0 and side.embedding.pooling is None
    env = {"LLAMA_ARG_EMBEDDING_BATCH_SIZE": "4", "LLAMA_ARG_POOLING": "cls", "LLAMA_ARG_RERANKING": "1"}
    side = settings(["--embedding-batch-size", "2", "--rerank-batch-size", "3", "--embd-normalize", "-1",
                     "--embedding-queue-depth", "5", "--embedding-request-timeout-secs", "9", "--embeddings",
                     "--reranker-model", "r", "--embedding-model", "e"], env).side
    assert side.embedding.worker.batch_size == 2  # the flag wins over its mirror
    assert side.embedding.pooling is PoolingType.CLS and side.embedding.normalize == -1
    assert (side.rerank.worker.batch_size, side.rerank.worker.queue_depth, side.rerank.worker.request_timeout_s) \
        == (3, 5, 9.0)
    assert side.is_embeddings_mode and side.is_reranking_mode
    assert (side.embedding_model, side.reranker_model) == ("e", "r")
    assert settings(["--rerank"]).side.is_reranking_mode and settings(["--embedding"]).side.is_embeddings_mode


def test_c2_c5_media_flags_and_environment(tmp_path: Path) -> None:
    media = settings([]).media
    assert media is not None and media.media_root is None and not media.allow_private_urls
    env = {"MLXCEL_ALLOW_PRIVATE_MEDIA_URLS": "1", "MLXCEL_VIDEO_FPS": "4", "MLXCEL_VIDEO_MAX_FRAMES": "8",
           "MLXCEL_VIDEO_DIR_ALLOWLIST": str(tmp_path)}
    media = settings(["--media-path", str(tmp_path), "--max-image-payload-size", "1M", "--max-images", "3",
                      "--video-fps", "1.5"], env).media
    assert media is not None and media.media_root is not None and media.media_root.canonical == tmp_path.resolve()
    assert (media.max_image_payload_bytes, media.max_images) == (1 << 20, 3)
    assert (media.video_fps, media.video_max_frames) == (1.5, 8)  # --video-fps wins over MLXCEL_VIDEO_FPS
    assert media.allow_private_urls and media.video_dir_allowlist == (tmp_path.resolve(),)
    with pytest.raises(MediaConfigError, match="--media-path"):
        settings(["--media-path", str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="MLXCEL_VIDEO_DIR_ALLOWLIST"):
        settings([], {"MLXCEL_VIDEO_DIR_ALLOWLIST": "relative/dir"})
