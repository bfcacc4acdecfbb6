"""The routes table: every path the server answers, its methods, handler, protocol and auth.

Handlers take (request, state) and return a Starlette Response or an API Reply. `bind`
wraps each one so an ApiError becomes its protocol's envelope and nothing else escapes as
a framework default (no 422s, no HTML 500s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from mlxcel.api import openai, providers, responses, resumable
from mlxcel.api.context import ApiContext
from mlxcel.api import anthropic, llama_server
from mlxcel.api.errors import ApiError, Protocol, unavailable
from mlxcel.api.openai.florence2 import create_florence2_completion
from mlxcel.api.openai.schemas import ChatCompletionRequest
from mlxcel.api.replies import JsonReply, Reply, StreamReply
from mlxcel.server import audio_routes, ops, settings_api
from mlxcel.server.openapi import build_openapi
from mlxcel.server.body import read_json
from mlxcel.server.responses import error_response, internal_error, to_response
from mlxcel.server.state import ServerState

log = logging.getLogger(__name__)

Handler = Callable[[Request, ServerState], Awaitable[Response | Reply]]
CLIENT_CLOSED_STATUS = 499  # nginx's "client closed request"; never reaches the (gone) client


@dataclass(frozen=True, slots=True)
class Route:
    paths: tuple[str, ...]
    methods: tuple[str, ...]
    handler: Handler
    protocol: Protocol = "openai"
    is_public: bool = False  # no API key needed (C1)


class ClientGoneError(Exception):
    """The client disconnected before a non-streaming reply was ready."""


async def run_until_disconnect(request: Request, work: Coroutine[Any, Any, Reply]) -> Reply:
    """Await `work`, cancelling it (and so aborting its generation) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pending
    if task.cancelled():
        raise ClientGoneError
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def bind(route: Route, state: ServerState) -> Callable[[Request], Awaitable[Response]]:
    """The Starlette endpoint for `route`: errors in its protocol's envelope."""
    async def endpoint(request: Request) -> Response:
        try:
            result = await route.handler(request, state)
        except ApiError as exc:
            if 400 <= exc.status < 500:  # a refused request shows in the log (issue 46), as llama-server's do
                log.info("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message[:300])
            return error_response(exc, route.protocol)
        except (ClientGoneError, ClientDisconnect):
            return Response(status_code=CLIENT_CLOSED_STATUS)
        except Exception as exc:  # noqa: BLE001 - a bug, reported as a 500 envelope
            state.metrics.record_failed_request("internal")  # issue 44: /metrics counts it
            return internal_error(exc, route.protocol, f"{request.method} {request.url.path}")
        return result if isinstance(result, Response) else to_response(result)

    endpoint.__name__ = route.handler.__name__
    return endpoint


# ---- OpenAI routes (F1, F5) ----

async def chat_completions(request: Request, state: ServerState) -> Reply:
    req = openai.parse_chat_request(await read_json(request))  # D1: body errors before availability
    if state.side.florence2 is not None:  # spec T: a Florence-2 process answers here, on its own worker
        return await run_until_disconnect(request, _florence2_completion(state, req))
    ctx = state.require_api()
    cid = resumable.conversation_id(request.headers)
    reply = await run_until_disconnect(request, openai.create_chat_completion(ctx, req, request.headers))
    return await _resumable(state, reply, cid)


async def _florence2_completion(state: ServerState, req: ChatCompletionRequest) -> Reply:
    provider, info = state.side.florence2, state.side.florence2_info
    assert provider is not None and info is not None
    if state.is_shutting_down:
        raise unavailable("the server is shutting down")
    return await create_florence2_completion(provider, req, state.media, info.name, state.metrics)


async def _resumable(state: ServerState, reply: Reply, cid: str | None) -> Reply:
    # F6: a stream is buffered under its X-Conversation-Id (given or assigned) for GET /v1/stream.
    return await state.streams.open(reply, cid) if isinstance(reply, StreamReply) else reply


async def chat_input_tokens(request: Request, state: ServerState) -> Reply:
    req = openai.parse_chat_request(await read_json(request))
    return openai.count_chat_input_tokens(state.require_api(), req)


async def chat_control(request: Request, state: ServerState) -> Reply:
    req = openai.parse_control_request(await read_json(request))  # D1: body errors before availability
    return openai.control_chat_completion(state.require_api(), req)


async def completions(request: Request, state: ServerState) -> Reply:
    req = openai.parse_completion_request(await read_json(request))
    ctx = state.require_api()
    return await run_until_disconnect(request, openai.create_completion(ctx, req, request.headers))


def _chat_api_or_none(state: ServerState) -> ApiContext | None:
    # A single-purpose process (embedding-only, rerank-only) lists only its providers (spec I).
    if state.side.mode is not None or (state.config.webui and state.api is None):  # A5: model-less
        return None
    return state.require_api()


async def models(request: Request, state: ServerState) -> Reply:
    return openai.list_models(_chat_api_or_none(state), state.side.model_entries())


async def model(request: Request, state: ServerState) -> Reply:
    return openai.retrieve_model(_chat_api_or_none(state), request.path_params["model_id"],
                                 state.side.model_entries())


# ---- embeddings and rerank (spec I, F1, F3, F4) ----

async def embeddings(request: Request, state: ServerState) -> Reply:
    body = await read_json(request)
    provider, name = state.require_embedding()
    return await run_until_disconnect(request, providers.openai_embeddings(provider, body, name))


async def native_embeddings(request: Request, state: ServerState) -> Reply:
    body = await read_json(request)
    provider, _ = state.require_embedding()
    return await run_until_disconnect(request, providers.native_embeddings(provider, body))


async def rerank(request: Request, state: ServerState) -> Reply:
    body = await read_json(request)
    reranker, name = state.require_reranker()
    return await run_until_disconnect(request, providers.rerank_documents(reranker, body, name))


# ---- llama-server native routes (F4) ----

async def native_completion(request: Request, state: ServerState) -> Reply:
    req = llama_server.parse_completion_request(await read_json(request))  # D1: body errors first
    ctx = state.require_api()
    return await run_until_disconnect(request, llama_server.create_completion(ctx, req, request.headers))


async def infill(request: Request, state: ServerState) -> Reply:
    req = llama_server.parse_infill_request(await read_json(request))
    ctx = state.require_api()
    return await run_until_disconnect(request, llama_server.create_infill(ctx, req, request.headers))


async def tokenize(request: Request, state: ServerState) -> Reply:
    req = llama_server.parse_tokenize_request(await read_json(request))
    return llama_server.tokenize(state.require_api(), req)


async def tokenizer_info(request: Request, state: ServerState) -> Reply:
    return llama_server.tokenizer_info(state.require_api())


async def detokenize(request: Request, state: ServerState) -> Reply:
    req = llama_server.parse_detokenize_request(await read_json(request))
    return llama_server.detokenize_tokens(state.require_api().tokenizer, req)


async def apply_template(request: Request, state: ServerState) -> Reply:
    req = llama_server.parse_apply_template_request(await read_json(request))
    return llama_server.apply_template(state.require_api(), req)


async def lora_adapters(request: Request, state: ServerState) -> Reply:
    return llama_server.list_adapters(state.require_api())


async def set_lora_adapters(request: Request, state: ServerState) -> Reply:
    entries = llama_server.parse_lora_request(await read_json(request))
    return llama_server.set_adapters(state.require_api(), entries)


# ---- Anthropic Messages (E1, E2) ----

def _anthropic_options(state: ServerState) -> anthropic.AnthropicOptions:
    return anthropic.AnthropicOptions(pin_billing_stamp=state.config.anthropic_pin_billing_stamp)


async def messages(request: Request, state: ServerState) -> Reply:
    req = anthropic.parse_messages_request(await read_json(request))  # D1: body errors first
    ctx = state.require_api()
    work = anthropic.create_message(ctx, req, request.headers, _anthropic_options(state))
    return await run_until_disconnect(request, work)


async def count_tokens(request: Request, state: ServerState) -> Reply:
    req = anthropic.parse_count_tokens_request(await read_json(request))
    return await anthropic.count_message_tokens(state.require_api(), req, _anthropic_options(state))


# ---- OpenAI Responses (F2, F5) ----

async def responses_create(request: Request, state: ServerState) -> Reply:
    req = responses.parse_create_request(await read_json(request))  # D1: body errors before availability
    ctx = state.require_api()
    cid = resumable.conversation_id(request.headers)
    work = responses.create_response(ctx, state.responses, req, request.headers)
    return await _resumable(state, await run_until_disconnect(request, work), cid)


async def responses_input_tokens(request: Request, state: ServerState) -> Reply:
    req = responses.parse_input_tokens_request(await read_json(request))
    return await responses.count_input_tokens(state.require_api(), state.responses, req)


async def responses_compact(request: Request, state: ServerState) -> Reply:
    req = responses.parse_compact_request(await read_json(request))
    ctx = state.require_api()
    return await run_until_disconnect(request, responses.compact_response(ctx, state.responses, req))


async def responses_retrieve(request: Request, state: ServerState) -> Reply:
    return await responses.retrieve_response(state.responses, request.path_params["response_id"],
                                             request.query_params, keepalive_s=state.config.sse_keepalive_s)


async def responses_delete(request: Request, state: ServerState) -> Reply:
    return await responses.delete_response(state.responses, request.path_params["response_id"])


async def responses_cancel(request: Request, state: ServerState) -> Reply:
    return await responses.cancel_response(state.responses, request.path_params["response_id"])


async def responses_input_items(request: Request, state: ServerState) -> Reply:
    return await responses.list_input_items(state.responses, request.path_params["response_id"],
                                            request.query_params)


# ---- resumable streams (F6) ----

def _stream_id(request: Request) -> str:
    value = request.query_params.get("conversation_id") or request.headers.get(resumable.CONVERSATION_HEADER)
    if value is None:
        raise _missing_stream_id("conversation_id")
    return resumable.checked_id(value, "conversation_id")


def _missing_stream_id(name: str) -> ApiError:
    return ApiError(400, f"the '{name}' query parameter (or the X-Conversation-Id header) is required",
                    code=400, extra={"param": name})


async def stream_replay(request: Request, state: ServerState) -> Reply:
    offset = resumable.parse_offset(request.query_params.get("offset"))
    return state.streams.replay(_stream_id(request), offset)


async def stream_delete(request: Request, state: ServerState) -> Reply:
    return JsonReply(await state.streams.delete(_stream_id(request)))


async def streams_lookup(request: Request, state: ServerState) -> Reply:
    return JsonReply(state.streams.lookup(resumable.parse_lookup_ids(await read_json(request))))


# ---- audio (spec G) ----

async def audio_transcriptions(request: Request, state: ServerState) -> Reply:
    work = await audio_routes.transcription_work(request, state, "transcribe")  # the upload is read first
    return await run_until_disconnect(request, work)


async def audio_translations(request: Request, state: ServerState) -> Reply:
    work = await audio_routes.transcription_work(request, state, "translate")
    return await run_until_disconnect(request, work)


async def audio_speech(request: Request, state: ServerState) -> Reply:
    return await run_until_disconnect(request, await audio_routes.speech_work(request, state))


async def openapi_json(request: Request, state: ServerState) -> Response:
    # issue 16: the routes this process mounted (the image routes only with --image-model), for clients and fuzzers
    return JSONResponse(build_openapi(getattr(request.app.state, "api_routes", ROUTES)))


ROUTES: tuple[Route, ...] = (
    Route(("/v1/chat/completions", "/chat/completions"), ("POST",), chat_completions),
    Route(("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"), ("POST",), chat_input_tokens),
    Route(("/v1/chat/completions/control", "/chat/completions/control"), ("POST",), chat_control),
    Route(("/v1/completions",), ("POST",), completions),
    Route(("/v1/responses", "/responses"), ("POST",), responses_create),
    Route(("/v1/responses/input_tokens", "/responses/input_tokens"), ("POST",), responses_input_tokens),
    Route(("/v1/responses/compact", "/responses/compact"), ("POST",), responses_compact),
    Route(("/v1/responses/{response_id}", "/responses/{response_id}"), ("GET",), responses_retrieve),
    Route(("/v1/responses/{response_id}", "/responses/{response_id}"), ("DELETE",), responses_delete),
    Route(("/v1/responses/{response_id}/cancel", "/responses/{response_id}/cancel"), ("POST",), responses_cancel),
    Route(("/v1/responses/{response_id}/input_items", "/responses/{response_id}/input_items"), ("GET",),
          responses_input_items),
    Route(("/completion", "/completions"), ("POST",), native_completion),
    Route(("/infill",), ("POST",), infill),
    Route(("/tokenize",), ("POST",), tokenize),
    Route(("/tokenizer_info",), ("GET",), tokenizer_info),  # vLLM's, for evaluation clients (issue 26)
    Route(("/detokenize",), ("POST",), detokenize),
    Route(("/apply-template",), ("POST",), apply_template),
    Route(("/lora-adapters",), ("GET",), lora_adapters),
    Route(("/lora-adapters",), ("POST",), set_lora_adapters),
    Route(("/v1/messages", "/messages"), ("POST",), messages, protocol="anthropic"),
    Route(("/v1/messages/count_tokens", "/messages/count_tokens"), ("POST",), count_tokens, protocol="anthropic"),
    Route(("/v1/models", "/models"), ("GET",), models),
    Route(("/v1/embeddings",), ("POST",), embeddings),
    Route(("/embedding", "/embeddings"), ("POST",), native_embeddings),
    Route(("/v1/rerank", "/v1/reranking", "/rerank", "/reranking"), ("POST",), rerank),
    Route(("/v1/models/{model_id:path}", "/models/{model_id:path}"), ("GET",), model),
    Route(("/", "/health", "/v1/health"), ("GET",), ops.health, is_public=True),
    Route(("/slots",), ("GET",), ops.slots),
    Route(("/slots/{id_slot}",), ("POST",), ops.slot_action),
    Route(("/props",), ("GET",), ops.props),
    Route(("/metrics",), ("GET",), ops.metrics),
    Route(("/v1/cache/stats",), ("GET",), ops.cache_stats),
    Route(("/v1/cache/reset",), ("POST",), ops.cache_reset),
    Route(("/v1/internal/mtp-policy",), ("GET",), ops.mtp_policy),  # F10
    Route(("/tools", "/cors-proxy"), ("GET", "POST"), ops.feature_disabled),
    Route(("/v1/settings", "/settings"), ("GET",), settings_api.get_settings),  # F9
    Route(("/v1/settings", "/settings"), ("PATCH",), settings_api.patch_settings),
    Route(("/v1/stream",), ("GET",), stream_replay),
    Route(("/v1/stream",), ("DELETE",), stream_delete),
    Route(("/v1/streams/lookup",), ("POST",), streams_lookup),
    Route(("/v1/audio/transcriptions", "/audio/transcriptions"), ("POST",), audio_transcriptions),
    Route(("/v1/audio/translations", "/audio/translations"), ("POST",), audio_translations),
    Route(("/v1/audio/speech", "/audio/speech"), ("POST",), audio_speech),
    Route(("/openapi.json",), ("GET",), openapi_json, is_public=True),  # issue 16: for clients and fuzzers
)


def public_paths(routes: tuple[Route, ...] = ROUTES) -> frozenset[str]:
    return frozenset(path for route in routes if route.is_public for path in route.paths)
