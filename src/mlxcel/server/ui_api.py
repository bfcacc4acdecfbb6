"""The web UI's control plane, `/ui-api/v1/*` (A5): always authenticated, mounted with --webui.

Every route needs a key in a header (`Authorization: Bearer` or `X-Api-Key`; never a cookie,
so a page on another site cannot ride on it): the API key, or the one-time session key of a
loopback listener started without one. State-changing calls also pass the Origin check (C6).
Model actions and downloads answer 202 with a job; `/events` streams job progress, model
state changes and a counters sample every second as SSE.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlxcel.api.errors import ApiError, invalid_api_key, invalid_request
from mlxcel.server.auth import is_valid_key, presented_key
from mlxcel.server.body import read_json
from mlxcel.server.cors import OriginPolicy
from mlxcel.server.jobs import Job, JobCancelled
from mlxcel.server.model_control import DEFAULT_DRAIN_TIMEOUT_S, RETIRE_MODES, ModelControl
from mlxcel.server.ops import disk_cache_json, host_cache_json
from mlxcel.server.responses import SSE_HEADERS
from mlxcel.server.routes import Handler, Route
from mlxcel.server.state import ServerState

UI_API = "/ui-api/v1"
SIDE_ROLES = ("embedding", "rerank")
EVENT_POLL_S = 0.2
STATS_EVERY_S = 1.0


def _control(state: ServerState) -> ModelControl:
    control = state.control  # held as its ModelActions view: the state never imports this module's kind
    if not isinstance(control, ModelControl):
        raise ApiError(404, "the web UI control plane is off: start the server with --webui", "not_found_error",
                       code=404)
    return control


def guarded(handler: Callable[[Request, ServerState, ModelControl], Awaitable[Response]]) -> Handler:
    """Key check on every call; Origin check on state-changing ones (A5, C6)."""
    async def checked(request: Request, state: ServerState) -> Response:
        control = _control(state)
        keys = state.config.ui_keys
        if not keys or not is_valid_key(presented_key(request.scope["headers"]), keys):
            raise invalid_api_key()
        if request.method not in ("GET", "HEAD"):
            refusal = OriginPolicy(state.config.cors_origins).refusal(request.headers, "change this server")
            if refusal is not None:
                raise refusal
        return await handler(request, state, control)

    checked.__name__ = handler.__name__
    return checked


# ---- reading ----

async def bootstrap(request: Request, state: ServerState, control: ModelControl) -> Response:
    from mlxcel.server.ops import _version

    config, settings = state.config, control.settings
    return JSONResponse({
        "server": {"name": "mlxcel", "version": _version()},
        "settings": {"api_prefix": config.api_prefix, "auth": "api-key" if config.api_keys else "session-key",
                     "models_dir": str(store_dir(control)), "device": settings.device,
                     "parallel": settings.engine.max_num_seqs, "ctx_size": settings.engine.ctx_size,
                     "cors_origins": list(config.cors_origins) if config.cors_origins is not None else None,
                     "tls": config.is_tls},
        "models": control.model_states(),
        "features": {"settings_page": False},  # the UI has no settings page; /v1/settings is the API (F9)
        "last_event_seq": control.events.last_seq,
    })


async def catalog(request: Request, state: ServerState, control: ModelControl) -> Response:
    entries = await asyncio.to_thread(_catalog_entries, state, control)
    return JSONResponse({"models_dir": str(store_dir(control)), "data": entries})


def _catalog_entries(state: ServerState, control: ModelControl) -> list[dict[str, Any]]:
    from mlxcel.loading.store import list_store

    loaded = control.loaded_paths()
    side = {state.side.embedding_info.name: "embedding"} if state.side.embedding_info else {}
    side |= {state.side.reranker_info.name: "rerank"} if state.side.reranker_info else {}
    entries = []
    for entry in list_store(store_dir(control)):
        loaded_as = "chat" if str(Path(entry.path).resolve()) in loaded else side.get(entry.id or entry.name)
        entries.append({**entry.to_json(), "loaded_as": loaded_as})
    return entries


async def models_state(request: Request, state: ServerState, control: ModelControl) -> Response:
    return JSONResponse(control.model_states())


async def runtime(request: Request, state: ServerState, control: ModelControl) -> Response:
    return JSONResponse(runtime_json(state, control))


def runtime_json(state: ServerState, control: ModelControl) -> dict[str, Any]:
    """Slots, queue, KV cache, prefix cache and throughput: the figures /metrics has, as JSON."""
    served = state.served
    stats = served.engine.stats() if served is not None else None
    body: dict[str, Any] = {"model": state.model_name if served is not None else None,
                            "workers": [_worker(w) for w in state.side.stats()]}
    if stats is None:
        return body | {"slots": [], "queue_depth": 0, "active": 0, "max_batch_size": 0, "kv": None,
                       "prefix_cache": None, "throughput": {"generated_tokens_per_s": 0.0, "prompt_tokens_per_s": 0.0},
                       "counters": None}
    generated, prompt = control.throughput.sample(served, stats.tokens_generated, stats.prompt_tokens_processed)
    cache = stats.prefix_cache
    num_blocks = cache.num_blocks_used + cache.num_blocks_free
    lookups = cache.num_hits + cache.num_misses
    return body | {
        "slots": [{"id": s.slot_id, "is_processing": s.is_processing, "n_prompt_tokens": s.num_prompt_tokens,
                   "n_decoded": s.num_generated_tokens, "context_size": s.context_size} for s in stats.slots],
        "queue_depth": stats.queue_depth, "active": stats.active_sequences, "max_batch_size": stats.max_batch_size,
        "kv": {"blocks_used": cache.num_blocks_used, "blocks_free": cache.num_blocks_free,
               "blocks_cached": cache.num_blocks_cached, "usage": cache.num_blocks_used / num_blocks if num_blocks else 0.0},
        "prefix_cache": {"enabled": cache.is_enabled, "hits": cache.num_hits, "misses": cache.num_misses,
                         "hit_rate": cache.num_hits / lookups if lookups else 0.0, "reused_tokens": cache.num_reused_tokens,
                         "evictions": cache.num_evictions, "host": host_cache_json(cache.host),
                         "disk": disk_cache_json(cache.disk)},
        "throughput": {"generated_tokens_per_s": round(generated, 2), "prompt_tokens_per_s": round(prompt, 2)},
        "counters": {"requests_started": stats.sequences_started, "requests_completed": stats.sequences_completed,
                     "tokens_generated": stats.tokens_generated, "prompt_tokens": stats.prompt_tokens_processed},
    }


def _worker(stats: Any) -> dict[str, Any]:
    return {"name": getattr(stats, "name", None), "queue_depth": stats.queue_depth,
            "requests": stats.num_requests, "completed": stats.num_completed}


# ---- model actions (jobs) ----

async def _body(request: Request) -> dict[str, Any]:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise invalid_request("the request body must be a JSON object")
    return body


def _text(body: dict[str, Any], name: str, default: str | None = None) -> str:
    value = body.get(name, default)
    if not isinstance(value, str):
        raise invalid_request(f"'{name}' must be a string" if name in body else f"'{name}' is required")
    return value


def _retire_options(body: dict[str, Any]) -> tuple[str, float]:
    mode = _text(body, "mode", "drain")
    if mode not in RETIRE_MODES:
        raise invalid_request(f"'mode' must be one of {', '.join(RETIRE_MODES)}, not {mode!r}")
    timeout = body.get("drain_timeout_s", DEFAULT_DRAIN_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
        raise invalid_request("'drain_timeout_s' must be a number of seconds >= 0")
    return mode, float(timeout)


def _role(body: dict[str, Any]) -> str:
    role = _text(body, "role", "chat")
    if role not in ("chat", *SIDE_ROLES):
        raise invalid_request(f"'role' must be chat, embedding or rerank, not {role!r}")
    return role


def _accepted(job: Job) -> Response:
    return JSONResponse({"job": job.to_json()}, 202)


async def load(request: Request, state: ServerState, control: ModelControl) -> Response:
    body = await _body(request)
    model_id, role = _text(body, "model", ""), _role(body)
    if role == "chat":
        job = control.jobs.submit("load", model_id, lambda job: control.load_chat(job, model_id))
    else:
        job = control.jobs.submit(f"load_{role}", model_id, lambda job: control.load_side(job, role, model_id))
    return _accepted(job)


async def unload(request: Request, state: ServerState, control: ModelControl) -> Response:
    body = await _body(request)
    role = _role(body)
    if role == "chat":
        mode, timeout = _retire_options(body)
        job = control.jobs.submit("unload", None, lambda job: control.unload_chat(job, mode, timeout))
    else:
        job = control.jobs.submit(f"unload_{role}", None, lambda job: control.unload_side(job, role))
    return _accepted(job)


async def switch(request: Request, state: ServerState, control: ModelControl) -> Response:
    body = await _body(request)
    model_id = _text(body, "model")
    mode, timeout = _retire_options(body)
    job = control.jobs.submit("switch", model_id, lambda job: control.switch_chat(job, model_id, mode, timeout))
    return _accepted(job)


async def download(request: Request, state: ServerState, control: ModelControl) -> Response:
    from mlxcel.loading.resolve import _REPO_ID

    repo_id = _text(await _body(request), "repo_id")
    if not _REPO_ID.match(repo_id):
        raise invalid_request(f"'repo_id' must be a Hugging Face repo id (owner/name), not {repo_id!r}")
    job = control.jobs.submit("download", repo_id, lambda job: _download(control, job, repo_id),
                              is_model_action=False)
    return _accepted(job)


def _download(control: ModelControl, job: Job, repo_id: str) -> dict[str, Any]:
    from mlxcel.loading.store import DownloadCancelled, download_repo

    def progress(done: int, total: int, name: str) -> None:
        job.message = f"{name or 'listing files'}: {done} / {total} bytes"
        control.jobs.update(job, progress=done / total if total else 0.0)

    try:
        path = download_repo(repo_id, store_dir(control), progress, job.cancel_requested.is_set)
    except DownloadCancelled:
        raise JobCancelled(job.id) from None
    job.message = f"downloaded {repo_id}"
    return {"repo_id": repo_id, "path": str(path)}


async def delete(request: Request, state: ServerState, control: ModelControl) -> Response:
    from mlxcel.loading.errors import ModelLoadError
    from mlxcel.loading.store import delete_entry

    model_id = _text(await _body(request), "model")
    entries = {entry["id"]: entry for entry in await asyncio.to_thread(_catalog_entries, state, control)}
    entry = entries.get(model_id)
    if entry is None:
        raise ApiError(404, f"{model_id!r} is not in the catalog", "not_found_error", code=404)
    if entry["loaded_as"] is not None:
        raise ApiError(409, f"{entry['name']} is loaded as the {entry['loaded_as']} model: unload it first",
                       "conflict_error", code=409)
    try:
        await asyncio.to_thread(delete_entry, _store_entry(entry), store_dir(control))
    except (ModelLoadError, OSError) as exc:
        raise ApiError(409, str(exc), "conflict_error", code=409) from None
    control.events.publish("catalog", {"deleted": model_id})
    return JSONResponse({"deleted": model_id})


def _store_entry(entry: dict[str, Any]) -> Any:
    from mlxcel.loading.store import StoreEntry

    return StoreEntry(**{k: v for k, v in entry.items() if k != "loaded_as"})


def store_dir(control: ModelControl) -> Path:
    """--models-dir, else the Hugging Face cache (where `resolve_model` looks and downloads)."""
    if control.settings.models_dir is not None:
        return Path(control.settings.models_dir).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


# ---- jobs and events ----

async def jobs(request: Request, state: ServerState, control: ModelControl) -> Response:
    return JSONResponse({"data": [job.to_json() for job in control.jobs.list()]})


def _job(control: ModelControl, request: Request) -> Job:
    job = control.jobs.get(request.path_params["job_id"])
    if job is None:
        raise ApiError(404, f"no job {request.path_params['job_id']!r}", "not_found_error", code=404)
    return job


async def job_status(request: Request, state: ServerState, control: ModelControl) -> Response:
    return JSONResponse({"job": _job(control, request).to_json()})


async def job_cancel(request: Request, state: ServerState, control: ModelControl) -> Response:
    job = _job(control, request)
    if job.is_done:
        raise ApiError(409, f"job {job.id} already {job.state}", "conflict_error", code=409)
    control.jobs.cancel(job)
    return JSONResponse({"job": job.to_json()}, 202)


async def events(request: Request, state: ServerState, control: ModelControl) -> Response:
    try:
        since = int(request.query_params.get("since", control.events.last_seq))
    except ValueError:
        raise invalid_request("'since' must be an event sequence number") from None
    return StreamingResponse(_event_frames(state, control, since), media_type="text/event-stream",
                             headers=SSE_HEADERS)


async def _event_frames(state: ServerState, control: ModelControl, since: int) -> AsyncIterator[str]:
    yield _frame("hello", {"models": control.model_states(), "last_event_seq": since}, since)
    loop = asyncio.get_running_loop()
    next_stats = 0.0
    while not state.is_shutting_down:
        for event in control.events.since(since):
            since = event["seq"]
            yield _frame(event["event"], event["data"], since)
        if loop.time() >= next_stats:
            next_stats = loop.time() + STATS_EVERY_S
            yield _frame("stats", runtime_json(state, control), None)
        await asyncio.sleep(EVENT_POLL_S)


def _frame(kind: str, data: dict[str, Any], seq: int | None) -> str:
    head = f"id: {seq}\n" if seq is not None else ""
    return f"{head}event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def ui_api_routes() -> tuple[Route, ...]:
    def route(path: str, method: str, handler: Callable[..., Awaitable[Response]]) -> Route:
        return Route((UI_API + path,), (method,), guarded(handler))

    return (
        route("/bootstrap", "GET", bootstrap),
        route("/catalog", "GET", catalog),
        route("/models", "GET", models_state),
        route("/models/load", "POST", load),
        route("/models/unload", "POST", unload),
        route("/models/switch", "POST", switch),
        route("/models/delete", "POST", delete),
        route("/downloads", "POST", download),
        route("/jobs", "GET", jobs),
        route("/jobs/{job_id}", "GET", job_status),
        route("/jobs/{job_id}/cancel", "POST", job_cancel),
        route("/events", "GET", events),
        route("/runtime", "GET", runtime),
    )
