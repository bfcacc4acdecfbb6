"""Operations endpoints: /health (K1), /slots (K3, F12), /props, /metrics (K2), prompt cache (F7), F11.

Each formats one `EngineStats` snapshot; none of them touches the engine's state directly
(cache reset and slot actions run on the engine thread through the client).
"""

from __future__ import annotations

import time
from importlib.metadata import PackageNotFoundError, version
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxcel.api.context import SamplingDefaults
from mlxcel.api.errors import ApiError, invalid_request
from mlxcel.api.llama_samplers import LlamaSamplerFields
from mlxcel.api.llama_server.schemas import UINT32_RANDOM_SEED
from mlxcel.server.body import read_json
from mlxcel.server.metrics import CONTENT_TYPE
from mlxcel.server.state import ServerState
from mlxcel.serving.process import FLORENCE2_CAPABILITY, SideModels
from mlxcel.types import (MTP_POLICY_VERSION, MTP_STATES, DiffusionStats, DiskCacheStats, DraftStats, EngineStats,
                          HostCacheStats, MtpDecision, PrefixCacheReset, PrefixCacheStats, RecurrentStateStats,
                          SlotStats)

if TYPE_CHECKING:
    from mlxcel.workers.base import WorkerStats

SLOT_ACTIONS = ("save", "restore", "erase")


def not_supported(what: str, flag: str) -> ApiError:
    """llama-server's answer for an endpoint switched off by a flag."""
    return ApiError(501, f"This server does not support the {what} endpoint. Start it with `{flag}`",
                    "not_supported_error", code=501)


# ---- /health (K1) ----

def health_json(state: ServerState, stats: EngineStats | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "status": _health_status(state, stats),
        "model": state.model_name,
        "batch": {"active_sequences": stats.active_sequences if stats else 0,
                  "queue_depth": stats.queue_depth if stats else 0,
                  "max_batch_size": stats.max_batch_size if stats else 0},
        "observability": {"sequences_started": stats.sequences_started if stats else 0,
                          "sequences_completed": stats.sequences_completed if stats else 0,
                          "sequences_aborted": stats.sequences_aborted if stats else 0},
        "context_size": stats.context_size if stats else 0,
        "tool_call_parser": _tool_call_parser(state),  # the format chosen from the chat template (V)
    }
    if stats is not None and stats.drafts.kind != "none":  # B1-B4; off: K1's fields exactly
        body["speculative"] = drafts_json(stats.drafts)
    if stats is not None and stats.diffusion is not None:  # U: the serial block-diffusion worker
        body["block_diffusion"] = diffusion_json(stats.diffusion)
    providers = providers_json(state.side)
    if providers:  # embedding / rerank workers (spec I); a chat-only server keeps K1's fields exactly
        body["providers"] = providers
    return body


def drafts_json(drafts: DraftStats) -> dict[str, Any]:
    """Speculative decoding's configuration and its draft counters (/health, /props)."""
    return {"draft_kind": drafts.kind, "draft_max": drafts.draft_max, "draft_min": drafts.draft_min,
            "max_batch": drafts.max_batch, "draft_model": drafts.draft_model,
            "drafted_tokens": drafts.num_drafted, "accepted_tokens": drafts.num_accepted,
            "acceptance_rate": round(drafts.acceptance_rate, 4)}


def diffusion_json(diffusion: DiffusionStats) -> dict[str, Any]:
    return {"sampler": diffusion.sampler, "canvas_length": diffusion.canvas_length,
            "blocks_committed": diffusion.num_blocks, "denoising_steps": diffusion.num_steps,
            "requests_timed_out": diffusion.num_timed_out, "queue_depth": diffusion.queue_depth,
            "max_queue_depth": diffusion.max_queue_depth}


def _tool_call_parser(state: ServerState) -> str | None:
    features = state.api.features if state.api is not None else None
    return features.tool_parser_name if features is not None else None


def providers_json(side: SideModels) -> list[dict[str, Any]]:
    """Each side provider: its model, capability and worker queue."""
    providers = ((side.embedding, side.embedding_info, "embedding"), (side.reranker, side.reranker_info, "rerank"),
                 (side.image, side.image_info, "image"))
    listed = [{"model": info.name, "capability": capability, **_worker_json(provider.stats())}
              for provider, info, capability in providers if provider is not None and info is not None]
    audio = [side.audio] if side.audio is not None else list(side.realtime or ())  # spec G, H
    for models in audio:
        listed.append({"model": models.name, "capability": models.capabilities[0],
                       "capabilities": list(models.capabilities), **_worker_json(models.stats())})
    if side.florence2 is not None and side.florence2_info is not None:  # spec T: the seq2seq worker
        listed.append({"model": side.florence2_info.name, "capability": FLORENCE2_CAPABILITY,
                       "worker": "florence2", **_worker_json(side.florence2.stats())})
    return listed


def _worker_json(stats: WorkerStats) -> dict[str, Any]:
    return {"queue_depth": stats.queue_depth, "max_queue_depth": stats.max_queue_depth,
            "requests": stats.num_requests, "completed": stats.num_completed, "rejected": stats.num_rejected,
            "timed_out": stats.num_timed_out}


def _health_status(state: ServerState, stats: EngineStats | None) -> str:
    if state.is_shutting_down:
        return "shutting down"
    if stats is None and state.side.mode is not None:
        return "ok"  # an embedding-only or rerank-only process: its providers loaded before it listened
    if stats is None:
        is_idle = state.config.webui and not (state.control is not None and state.control.loading)
        return "no model loaded" if is_idle else "loading model"  # A5: a model-less --webui start
    if not stats.is_alive and state.is_engine_recovering():
        return "restarting the engine process"  # issue 44: 503 until the new one is ready
    if not stats.is_alive:
        return "error: the engine stopped; see the server log"
    if stats.active_sequences >= stats.max_batch_size:
        return "no slot available"
    return "ok"


async def health(request: Request, state: ServerState) -> Response:
    """200 when loaded with a free slot, else 503 with the same fields."""
    body = health_json(state, state.engine_stats())
    return JSONResponse(body, 200 if body["status"] == "ok" else 503)


# ---- /slots (K3, F12) ----

def slot_json(slot: SlotStats) -> dict[str, Any]:
    # next_token is a one-item list, as llama-server sends it; an idle slot keeps no task's budget
    next_token = {"has_next_token": slot.is_processing, "n_remain": slot.num_remaining_tokens,
                  "n_decoded": slot.num_generated_tokens}
    return {
        "id": slot.slot_id, "n_ctx": slot.context_size, "context_size": slot.context_size, "speculative": False,
        "is_processing": slot.is_processing, "request_id": slot.request_id,
        "n_prompt_tokens": slot.num_prompt_tokens, "n_prompt_tokens_cached": slot.num_cached_tokens,
        "next_token": [next_token],
        **({"recurrent_state": {"bytes": slot.num_state_bytes, "snapshots": slot.num_state_snapshots}}
           if slot.num_state_bytes else {}),  # issue 41: a hybrid model's
    }


async def slots(request: Request, state: ServerState) -> Response:
    if not state.config.endpoint_slots:
        raise not_supported("slots", "--slots")
    stats = state.require_served().engine.stats()
    if request.query_params.get("fail_on_no_slot") in ("1", "true") and all(s.is_processing for s in stats.slots):
        raise ApiError(503, "no slot available", "unavailable_error", code=503)
    return JSONResponse([slot_json(s) for s in stats.slots])


async def slot_action(request: Request, state: ServerState) -> Response:
    """POST /slots/{id}?action=save|restore|erase (llama-server's slot snapshots)."""
    if not state.config.endpoint_slots:
        raise not_supported("slots", "--slots")
    action = request.query_params.get("action", "")
    if action not in SLOT_ACTIONS:
        raise invalid_request(f"action must be one of {', '.join(SLOT_ACTIONS)}, not {action!r}")
    slot_id = _slot_id(request.path_params["id_slot"])
    filename = await _slot_filename(request) if action != "erase" else ""
    served = state.require_served()
    if action != "erase" and not served.engine_config.slot_save_path:
        raise ApiError(501, "slot save/restore is off: start the server with --slot-save-path DIR",
                       "not_supported_error", code=501)
    return JSONResponse(await _run_slot_action(served.engine, action, slot_id, filename))


def _slot_id(text: str) -> int:
    if not (text.isascii() and text.isdigit() and len(text) <= 9):  # "²" is a digit to isdigit, not to int
        raise invalid_request(f"slot id must be a non-negative integer, not {text[:40]!r}")
    return int(text)


async def _slot_filename(request: Request) -> str:
    body = await read_json(request)
    filename = body.get("filename") if isinstance(body, dict) else None
    if not isinstance(filename, str) or not filename:
        raise invalid_request("filename: a non-empty string is required")
    return filename


async def _run_slot_action(engine: Any, action: str, slot_id: int, filename: str) -> dict[str, Any]:
    started = time.monotonic()
    try:
        if action == "erase":
            return {"id_slot": slot_id, "n_erased": await engine.erase_slot(slot_id)}
        method = engine.save_slot if action == "save" else engine.restore_slot
        result = await method(slot_id, filename)
    except ValueError as exc:  # the engine's SlotError: bad id, busy slot, missing file
        raise invalid_request(str(exc)) from None
    ms = (time.monotonic() - started) * 1000
    # F8: the adapter scales the KV was computed under; only requests under these scales reuse it
    lora = [{"id": i, "scale": scale} for i, scale in enumerate(result.lora_scales)]
    if action == "save":
        return {"id_slot": slot_id, "filename": result.filename, "n_saved": result.num_tokens,
                "n_written": result.num_bytes, "lora": lora, "timings": {"save_ms": ms}}
    return {"id_slot": slot_id, "filename": result.filename, "n_restored": result.num_tokens,
            "n_read": result.num_bytes, "lora": lora, "timings": {"restore_ms": ms}}


# ---- /props, /metrics ----

async def props(request: Request, state: ServerState) -> Response:
    if not state.config.endpoint_props:
        raise not_supported("props", "--props")
    served = state.require_served()
    template = served.chat_template
    stats = served.engine.stats()
    drafts = stats.drafts
    speculative = {"speculative": drafts_json(drafts)} if drafts.kind != "none" else {}
    live = state.live.current  # the settings table's values now: PATCH /v1/settings shows here at once (F9)
    return JSONResponse({
        "default_generation_settings": {"n_ctx": served.context_size,
                                        "params": _default_params(live, state.require_api().sampling),
                                        "sampling_sources": state.require_api().sampling.sources()},
        "total_slots": live["parallel"],
        "model_alias": state.model_name,
        "model_path": str(served.loaded.path),
        "model_implementation": served.loaded.implementation,  # "native" | "transformers" (the fallback)
        "weights": served.weights,  # issue 42: format, bits, group size, bytes resident and on disk
        "chat_template": template.source if template else "",
        "modalities": {"vision": served.image_marker is not None, "audio": False},  # issue 43: images in
        "bos_token": served.tokenizer.bos_token, "eos_token": served.tokenizer.eos_token,
        "build_info": f"mlxcel {_version()}",
        "prefix_cache_disk": disk_tier_props(stats.prefix_cache),
        **speculative,
        **({"recurrent_state": recurrent_state_json(stats.recurrent_state)} if stats.recurrent_state else {}),
    })


def recurrent_state_json(pool: RecurrentStateStats) -> dict[str, Any]:
    """A hybrid model's recurrent-state pool (issue 41), as /props shows it."""
    return {"bytes": pool.num_bytes, "bytes_per_sequence": pool.bytes_per_slot, "slots": pool.num_slots,
            "snapshots": pool.num_snapshots, "snapshot_slots": pool.num_snapshot_slots, "resumed": pool.num_resumed}


def disk_tier_props(cache: PrefixCacheStats | None) -> dict[str, Any]:
    """Where the prefix cache's disk tier keeps KV block files and how big that folder may grow (issue 47: the
    newcomer finds it here, not only in a startup log line); `enabled` false when it is off."""
    disk = cache.disk if cache is not None and cache.is_enabled else None
    if disk is None:
        return {"enabled": False, "directory": None, "capacity_bytes": 0, "size_bytes": 0, "files": 0}
    return {"enabled": True, "directory": disk.directory, "capacity_bytes": disk.capacity_bytes,
            "size_bytes": disk.size_bytes, "files": disk.num_files, "writable": disk.is_writable}


def _default_params(live: Mapping[str, Any], sampling: SamplingDefaults) -> dict[str, Any]:
    """What a request that names none of these gets: the server's -n and -s as the settings table holds them
    now (seed 4294967295 is llama-server's "random"), and for the sampler the server's default (--temp,
    --top-k, ...) where one is set, else the checkpoint's, else llama-server's (issue 46)."""
    seed = live["default_seed"]
    return {"seed": seed if seed >= 0 else UINT32_RANDOM_SEED, "n_predict": live["default_n_predict"],
            **sampling.values(), **LlamaSamplerFields().settings()}  # typical-p, XTC, mirostat, DRY...: off


def _version() -> str:
    try:
        return version("mlxcel")
    except PackageNotFoundError:
        return "unknown"


async def metrics(request: Request, state: ServerState) -> Response:
    if not state.config.endpoint_metrics:
        raise not_supported("metrics", "--metrics")
    # llama-server's header: scrapers tell a restarted process from counters that went down.
    response = Response(state.metrics.render(), media_type=CONTENT_TYPE)
    # NOTE: appended raw, in llama-server's casing (its test suite reads the header case-sensitively).
    response.raw_headers.append((b"Process-Start-Time-Unix", str(int(state.started_at)).encode()))
    return response


# ---- prompt cache (F7) ----

def cache_stats_json(cache: PrefixCacheStats | None) -> dict[str, Any]:
    """The same keys whether the cache is on or off (zeros when off)."""
    on = cache if cache is not None and cache.is_enabled else PrefixCacheStats(is_enabled=False)
    return {
        "object": "prompt_cache.stats", "enabled": on.is_enabled, "hits": on.num_hits, "misses": on.num_misses,
        "reused_tokens": on.num_reused_tokens, "evictions": on.num_evictions,
        "blocks": {"used": on.num_blocks_used, "free": on.num_blocks_free, "cached": on.num_blocks_cached},
        "host": host_cache_json(on.host), "disk": disk_cache_json(on.disk),
    }


def host_cache_json(host: HostCacheStats | None) -> dict[str, Any] | None:
    """The prefix cache's host-memory tier (issue 29 point 5); None when it is off."""
    if host is None:
        return None
    return {"pinned": host.is_pinned, "hits": host.num_hits, "misses": host.num_misses,
            "blocks_stored": host.num_blocks_stored, "blocks_loaded": host.num_blocks_loaded,
            "blocks_spilled": host.num_blocks_spilled, "blocks_dropped": host.num_blocks_dropped,
            "bytes_stored": host.num_bytes_stored,
            "bytes_loaded": host.num_bytes_loaded, "load_seconds": round(host.load_seconds, 6),
            "blocks": host.num_blocks, "size_bytes": host.size_bytes, "capacity_bytes": host.capacity_bytes}


def disk_cache_json(disk: DiskCacheStats | None) -> dict[str, Any] | None:
    """The prefix cache's disk tier (issue 29); None when it is off."""
    if disk is None:
        return None
    return {"directory": disk.directory, "writable": disk.is_writable, "hits": disk.num_hits,
            "misses": disk.num_misses, "skipped": disk.num_skipped, "blocks_written": disk.num_blocks_written,
            "blocks_read": disk.num_blocks_read, "bytes_written": disk.num_bytes_written,
            "bytes_read": disk.num_bytes_read, "load_seconds": round(disk.load_seconds, 6),
            "bad_files": disk.num_bad_files, "write_errors": disk.num_write_errors,
            "blocks_dropped": disk.num_blocks_dropped, "files": disk.num_files,
            "size_bytes": disk.size_bytes, "capacity_bytes": disk.capacity_bytes}


async def cache_stats(request: Request, state: ServerState) -> Response:
    stats = state.require_served().engine.stats()
    return JSONResponse(cache_stats_json(stats.prefix_cache))


async def cache_reset(request: Request, state: ServerState) -> Response:
    served = state.require_served()
    reset = await served.engine.reset_prefix_cache()
    enabled = served.engine.stats().prefix_cache.is_enabled
    return JSONResponse(cache_reset_json(reset, enabled))


def cache_reset_json(reset: PrefixCacheReset, enabled: bool) -> dict[str, Any]:
    """What the reset dropped from each tier (issue 29: the host and disk tiers too)."""
    return {"object": "prompt_cache.reset", "enabled": enabled, "reset": reset.is_reset,
            "dropped": {"blocks": reset.num_blocks, "host_blocks": reset.num_host_blocks,
                        "disk_files": reset.num_disk_files, "disk_bytes": reset.num_disk_bytes}}


# ---- F10 ----

def mtp_policy_json(name: str, decision: MtpDecision) -> dict[str, Any]:
    """The versioned read of the batch-1 MTP decision (F10)."""
    profile = decision.profile
    return {"object": "mtp_policy", "version": MTP_POLICY_VERSION, "model": name, "batch_size": 1,
            "state": decision.state, "enabled": decision.is_enabled, "reason": decision.reason,
            "mtp_layers": decision.num_mtp_layers, "states": list(MTP_STATES),
            "profile": None if profile is None else {
                "steps_with_mtp": profile.num_steps_on, "steps_without_mtp": profile.num_steps_off,
                "tokens_per_second_with_mtp": profile.tokens_per_second_on,
                "tokens_per_second_without_mtp": profile.tokens_per_second_off}}


async def mtp_policy(request: Request, state: ServerState) -> Response:
    served = state.require_served()
    return JSONResponse(mtp_policy_json(served.name, served.mtp))


# ---- F11 ----

async def feature_disabled(request: Request, state: ServerState) -> Response:
    """/tools and /cors-proxy: recognised llama-server routes, kept off (403 feature_disabled)."""
    raise ApiError(403, f"{request.url.path} is disabled on this server", "feature_disabled", code=403)
