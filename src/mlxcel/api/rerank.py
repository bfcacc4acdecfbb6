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

from mlxcel.api.embedding_input import InvalidRequestError, get_bool, get_positive_int, require_object
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
    """Either shape as typed values; InvalidRequestError (400) names the bad field."""
    body = require_object(body)
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise InvalidRequestError("'query' must be a non-empty string")
    is_tei = "texts" in body
    if is_tei and "documents" in body:
        raise InvalidRequestError("give 'documents' (Jina/Cohere) or 'texts' (TEI), not both")
    field = "texts" if is_tei else "documents"
    return RerankRequest(
        query=query,
        documents=_documents(body.get(field), field),
        is_tei=is_tei,
        top_n=get_positive_int(body, "top_n"),
        return_documents=get_bool(body, "return_text" if is_tei else "return_documents", False),
        raw_scores=get_bool(body, "raw_scores", False),
        truncate=get_bool(body, "truncate", False),
    )


def _documents(value: Any, field: str) -> list[str]:
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(f"'{field}' must be a non-empty list")
    return [_document_text(item, field, index) for index, item in enumerate(value)]


def _document_text(item: Any, field: str, index: int) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, Mapping) and isinstance(item.get("text"), str):
        return item["text"]
    raise InvalidRequestError(f"'{field}[{index}]' must be a string or an object with a 'text' string")


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
