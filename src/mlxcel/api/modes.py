"""What a process serves, as the API layer describes it (spec I): the model entries /v1/models
lists with their capabilities, and the 501s of a process that lacks a route's model.

An embedding-only or rerank-only process answers chat, completions and tokenizer routes with
a 501 whose body names its mode and the flag that would serve them; an embedding or rerank
route without its provider answers llama-server's 501 naming the flag that loads one.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxcel.api.errors import ApiError

NOT_SUPPORTED = "not_supported_error"


@dataclass(frozen=True, slots=True)
class SinglePurposeMode:
    """A process that serves no chat model: what it is, and the flag that would serve chat."""

    name: str  # "embedding-only", "rerank-only", "embedding-and-rerank-only"
    flag: str  # the flag to change: --embedding-model, --reranker-model, --embeddings, --reranking
    hint: str  # one sentence on how to start a server that also serves chat
    serves: str | None = None  # what it serves instead, when its name does not say (audio-only)


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One model a process serves, as /v1/models lists it."""

    name: str
    capabilities: tuple[str, ...]  # "completion", "embedding", "rerank", "transcription", "speech" ...
    created: int
    max_model_len: int


def chat_not_served(mode: SinglePurposeMode) -> ApiError:
    """501 for chat, completions and tokenizer routes in a single-purpose process (spec I)."""
    served = mode.serves or {"embedding-only": "embeddings", "rerank-only": "reranking"}.get(
        mode.name, "embeddings and reranking")
    message = (f"This server runs in {mode.name} mode: it serves {served}, not chat, completions or "
               f"tokenization. {mode.hint}")
    return ApiError(501, message, NOT_SUPPORTED, code=501, extra={"mode": mode.name, "flag": mode.flag})


def provider_missing(what: str, flag: str) -> ApiError:
    """501 for an embedding or rerank route when no such provider is loaded (llama-server's shape)."""
    return ApiError(501, f"This server does not support {what}. Start it with `{flag}`", NOT_SUPPORTED, code=501)


def audio_missing(what: str, checkpoint: str, served_audio: str | None) -> ApiError:
    """501 for an audio route this process has no model for; audio checkpoints get their own process."""
    now = f"this process serves {served_audio}" if served_audio else "this process serves no audio model"
    return ApiError(501, f"This server does not support {what}: {now}. Start a process with -m naming "
                    f"{checkpoint} (audio models are served in their own process).", NOT_SUPPORTED, code=501)
