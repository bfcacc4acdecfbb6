"""Embedding and rerank routes over the side providers (spec I, F1, F3, F4), protocol-neutral.

The protocol adapters (`openai.embeddings`, `llama_server.embeddings`, `rerank`) turn JSON
into provider calls; this module runs them with one error mapping: a bad field or input
(ValueError) is 400, a full or stopped worker 503, a request past
`--embedding-request-timeout-secs` 504.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

from mlxcel.api.errors import ApiError, invalid_request, unavailable
from mlxcel.api.llama_server.embeddings import create_native_embedding
from mlxcel.api.openai.embeddings import create_embeddings
from mlxcel.api.replies import JsonReply
from mlxcel.api.rerank import rerank
from mlxcel.workers.base import WorkerBusyError, WorkerError, WorkerStoppedError, WorkerTimeoutError
from mlxcel.workers.embedding import EmbeddingProvider
from mlxcel.workers.rerank import Reranker

T = TypeVar("T")
BUSY_RETRY_AFTER_S = 1


def from_worker_error(exc: WorkerError) -> ApiError:
    """503 for a full or stopped worker, 504 for a request past its deadline."""
    if isinstance(exc, WorkerTimeoutError):
        return ApiError(504, str(exc), "timeout_error", code=504)
    if isinstance(exc, WorkerBusyError):
        return unavailable(str(exc), BUSY_RETRY_AFTER_S)
    if isinstance(exc, WorkerStoppedError):
        return unavailable(str(exc))
    return ApiError(500, str(exc), "server_error", code=500)


class _Abortable(Protocol):
    def set(self) -> None: ...


async def next_from_worker(get: Callable[[], Awaitable[Any]], deadline: float, abort: _Abortable,
                           timeout_message: str) -> Any:
    """The next item a streaming worker job hands over, by the job's deadline (loop time): past it the
    job is told to stop and the request is a 504; an error it hands over is mapped as `run_on_provider` maps it."""
    remaining = deadline - asyncio.get_running_loop().time()
    try:
        item = await asyncio.wait_for(get(), max(remaining, 0.0))
    except TimeoutError:
        abort.set()
        raise ApiError(504, timeout_message, "timeout_error", code=504) from None
    if isinstance(item, WorkerError):
        raise from_worker_error(item)
    if isinstance(item, ValueError):
        raise invalid_request(str(item))
    if isinstance(item, BaseException):
        raise item
    return item


async def run_on_provider(work: Awaitable[T]) -> T:
    """Await a provider call, mapping its errors to ApiErrors (400, 503, 504)."""
    try:
        return await work
    except WorkerError as exc:
        raise from_worker_error(exc) from None
    except ValueError as exc:  # the workers' InputError: the request's fault
        raise invalid_request(str(exc)) from None


async def openai_embeddings(provider: EmbeddingProvider, body: Mapping[str, Any], model_name: str) -> JsonReply:
    """POST /v1/embeddings (F1)."""
    return JsonReply(await run_on_provider(create_embeddings(provider, body, model_name)))


async def native_embeddings(provider: EmbeddingProvider, body: Mapping[str, Any]) -> JsonReply:
    """POST /embedding and /embeddings in llama-server's shape (F4)."""
    return JsonReply(await run_on_provider(create_native_embedding(provider, body)))


async def rerank_documents(reranker: Reranker, body: Mapping[str, Any], model_name: str) -> JsonReply:
    """POST /v1/rerank, /v1/reranking, /rerank, /reranking (F3)."""
    return JsonReply(await run_on_provider(rerank(reranker, body, model_name)))
