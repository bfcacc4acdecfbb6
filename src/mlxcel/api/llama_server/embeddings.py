"""llama-server native `POST /embedding` and `/embeddings` (F4) <-> the embedding provider.

Not an alias of /v1/embeddings: the input comes as `input` or `content`, strings and token
lists may be mixed, and the answer is a bare list `[{"index": i, "embedding": [[...]]}]`
whose inner list holds one pooled vector, or one row per token with pooling none (raw,
not normalized, as llama-server returns them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlxcel.api.embedding_input import NativeEmbeddingBody, parse_body
from mlxcel.workers.embedding import EmbeddingOptions, EmbeddingProvider, EmbeddingResult


@dataclass(frozen=True, slots=True)
class NativeEmbeddingRequest:
    inputs: list[str | list[int]]
    options: EmbeddingOptions


def parse_native_embedding_request(body: Any) -> NativeEmbeddingRequest:
    """`input` (or the older `content`), `embd_normalize` and the `truncate` extension; ApiError (400)."""
    req = parse_body(NativeEmbeddingBody, body)
    return NativeEmbeddingRequest(req.input, EmbeddingOptions(truncate=req.truncate, normalize=req.embd_normalize))


def build_native_embedding_response(result: EmbeddingResult) -> list[dict[str, Any]]:
    """One entry per input; `embedding` is always a list of vectors."""
    return [
        {"index": index, "embedding": vector.tolist() if result.is_per_token else [vector.tolist()]}
        for index, vector in enumerate(result.embeddings)
    ]


async def create_native_embedding(provider: EmbeddingProvider, body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The whole route body: ValueError (400), WorkerBusyError (503), WorkerTimeoutError (504)."""
    request = parse_native_embedding_request(body)
    result = await provider.embed(request.inputs, request.options)
    return build_native_embedding_response(result)
