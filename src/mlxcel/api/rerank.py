"""Rerank routes (F3: /v1/rerank, /v1/reranking, /rerank, /reranking) <-> a Reranker.

Two request shapes, told apart by their field names as llama-server does:
- Jina/Cohere: `query`, `documents` (strings or `{"text": ...}` objects), `top_n`,
  `return_documents` -> `{"model", "object": "list", "usage", "results": [{"index",
  "relevance_score", "document"?: {"text"}}]}`.
- TEI: `query`, `texts`, `raw_scores`, `return_text` -> `[{"index", "score", "text"?}]`.
Results are sorted by score, highest first, with the documents' original indices.
`relevance_score` (and TEI's `score` unless `raw_scores`) is sigmoid(raw score): in
[0, 1] as Jina, Cohere and TEI give it; the order is the raw scores' order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlxcel.api.embedding_input import RerankBody, parse_body
from mlxcel.workers.rerank import Reranker, RerankResult


@dataclass(frozen=True, slots=True)
class RerankRequest:
    query: str
    documents: list[str]
    is_tei: bool
    top_n: int | None  # None = all
    return_documents: bool  # Jina/Cohere `return_documents`, TEI `return_text`
    raw_scores: bool  # TEI only
    truncate: bool


def parse_rerank_request(body: Any) -> RerankRequest:
    """Either shape as typed values; ApiError (400) names the bad field."""
    req = parse_body(RerankBody, body)
    return RerankRequest(
        query=req.query, documents=req.documents, is_tei=req.is_tei, top_n=req.top_n,
        return_documents=req.return_text if req.is_tei else req.return_documents,
        raw_scores=req.raw_scores, truncate=req.truncate,
    )


def sigmoid(score: float) -> float:
    if score >= 0:
        return 1.0 / (1.0 + math.exp(-score))
    exp = math.exp(score)  # the same value, without overflow for very negative scores
    return exp / (1.0 + exp)


def build_rerank_response(
    request: RerankRequest, result: RerankResult, model_name: str
) -> dict[str, Any] | list[dict[str, Any]]:
    """The response in the request's shape, best first, cut to `top_n`."""
    order = sorted(range(len(result.scores)), key=lambda index: -result.scores[index])
    order = order[: request.top_n] if request.top_n is not None else order
    if request.is_tei:
        return [_tei_entry(request, index, result.scores[index]) for index in order]
    tokens = result.num_prompt_tokens
    return {
        "model": model_name,
        "object": "list",
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": [_jina_entry(request, index, result.scores[index]) for index in order],
    }


def _tei_entry(request: RerankRequest, index: int, raw: float) -> dict[str, Any]:
    entry: dict[str, Any] = {"index": index, "score": raw if request.raw_scores else sigmoid(raw)}
    if request.return_documents:
        entry["text"] = request.documents[index]
    return entry


def _jina_entry(request: RerankRequest, index: int, raw: float) -> dict[str, Any]:
    entry: dict[str, Any] = {"index": index, "relevance_score": sigmoid(raw)}
    if request.return_documents:
        entry["document"] = {"text": request.documents[index]}
    return entry


async def rerank(
    reranker: Reranker, body: Mapping[str, Any], model_name: str
) -> dict[str, Any] | list[dict[str, Any]]:
    """The whole route body: ValueError (400), WorkerBusyError (503), WorkerTimeoutError (504)."""
    request = parse_rerank_request(body)
    result = await reranker.rerank(request.query, request.documents, request.truncate)
    return build_rerank_response(request, result, model_name)
