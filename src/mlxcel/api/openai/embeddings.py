"""OpenAI `POST /v1/embeddings` (F1) <-> the embedding provider.

`input` is a string, a list of strings, token ids or a list of token id lists;
`encoding_format` float or base64 (little-endian float32 bytes, as OpenAI sends them);
`dimensions` where the model allows it. Extensions: `truncate` (as in TEI and vLLM) cuts
inputs longer than the model window instead of answering 400; `embd_normalize`
(llama-server) overrides the normalization for this request.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlxcel.api.embedding_input import EmbeddingsBody, parse_body
from mlxcel.api.errors import invalid_request
from mlxcel.workers.embedding import EmbeddingOptions, EmbeddingProvider, EmbeddingResult, PoolingType


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    inputs: list[str | list[int]]
    model: str | None
    encoding_format: str  # "float" | "base64"
    options: EmbeddingOptions


def parse_embeddings_request(body: Any) -> EmbeddingsRequest:
    """The request body as typed values; ApiError (400) names the bad field."""
    req = parse_body(EmbeddingsBody, body)
    options = EmbeddingOptions(truncate=req.truncate, dimensions=req.dimensions, normalize=req.embd_normalize)
    return EmbeddingsRequest(inputs=req.input, model=req.model, encoding_format=req.encoding_format, options=options)


def check_pooling(pooling: PoolingType) -> None:
    """/v1/embeddings returns one vector per input, which pooling none does not give."""
    if pooling is PoolingType.NONE:
        raise invalid_request(
            "the embedding model runs with pooling 'none' (one vector per token), which "
            "/v1/embeddings cannot return; use /embedding or restart with --pooling mean|cls|last"
        )


def encode_base64(vector: np.ndarray) -> str:
    """Little-endian float32 bytes, base64: what the openai SDK decodes with numpy."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def build_embeddings_response(
    request: EmbeddingsRequest, result: EmbeddingResult, model_name: str
) -> dict[str, Any]:
    """The OpenAI response object for `result`."""
    encode = encode_base64 if request.encoding_format == "base64" else _as_floats
    data = [
        {"object": "embedding", "index": index, "embedding": encode(vector)}
        for index, vector in enumerate(result.embeddings)
    ]
    tokens = result.total_prompt_tokens
    return {
        "object": "list",
        "data": data,
        "model": model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def create_embeddings(provider: EmbeddingProvider, body: Mapping[str, Any], model_name: str) -> dict[str, Any]:
    """The whole route body: parse, embed on the provider's worker, format.

    Raises ValueError subclasses (400), WorkerBusyError (503), WorkerTimeoutError (504).
    """
    request = parse_embeddings_request(body)
    check_pooling(provider.pooling)
    result = await provider.embed(request.inputs, request.options)
    return build_embeddings_response(request, result, model_name)


def _as_floats(vector: np.ndarray) -> list[float]:
    return vector.tolist()
