"""The `/v1/realtime` WebSocket (spec H): the upgrade's checks, then an `api.realtime` session.

Before accepting: the API key (`Authorization: Bearer`, as every route: 401), the Origin
policy (a browser origin the policy does not allow: 403; no Origin header: accepted), and the
one-session gate (a second session is accepted only to be told `server_busy` and closed with
1013, the source's contract). Mounted only in a realtime process.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import JSONResponse
from starlette.websockets import WebSocket, WebSocketDisconnect

from mlxcel.api.errors import ApiError, error_body, invalid_api_key
from mlxcel.api.realtime import CLOSE_TRY_AGAIN, RealtimeService, RealtimeSession, error_event
from mlxcel.server.auth import is_valid_key, presented_key
from mlxcel.server.config import ServerConfig
from mlxcel.server.cors import OriginPolicy

log = logging.getLogger(__name__)

REALTIME_PATHS = ("/v1/realtime", "/realtime")


def realtime_endpoint(config: ServerConfig, service: RealtimeService) -> Callable[[WebSocket], Awaitable[None]]:
    """The WebSocket endpoint of `service`, behind `config`'s API keys and Origin policy."""
    async def endpoint(websocket: WebSocket) -> None:
        refusal = _refusal(websocket, config)
        if refusal is not None:
            await _deny(websocket, refusal)
            return
        await websocket.accept()
        if not service.gate.try_take():
            await websocket.send_text(json.dumps(error_event("server_busy", "server_busy", "another realtime "
                                                             "session is open; this server takes one at a time")))
            await websocket.close(CLOSE_TRY_AGAIN, "server busy")
            return
        try:
            await _serve(websocket, service)
        finally:
            service.gate.release()

    return endpoint


async def _serve(websocket: WebSocket, service: RealtimeService) -> None:
    async def send(event: dict[str, Any]) -> None:
        await websocket.send_text(json.dumps(event))

    async def receive() -> str | bytes | None:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return None
        return message.get("text") if message.get("text") is not None else message.get("bytes")

    session = RealtimeSession(service.engine, service.limits, service.model, send)
    try:
        code, reason = await session.run(receive)
    except (WebSocketDisconnect, RuntimeError):  # the client went away mid-send
        return
    log.info("realtime session %s closed: %s (%d)", session.session_id, reason, code)
    if code != 1000 or reason != "client closed":
        try:
            await websocket.close(code, reason)
        except RuntimeError:
            pass


def _refusal(websocket: WebSocket, config: ServerConfig) -> ApiError | None:
    keys = config.api_keys
    if keys and not is_valid_key(presented_key(websocket.scope["headers"]), keys):
        return invalid_api_key()
    # C6: the same Origin policy as every HTTP route (server/cors.py)
    return OriginPolicy(config.cors_origins).refusal(websocket.headers, "open a realtime session")


async def _deny(websocket: WebSocket, error: ApiError) -> None:
    try:
        await websocket.send_denial_response(JSONResponse(error_body(error), error.status))
    except RuntimeError:  # the server has no denial-response extension: a plain refusal (HTTP 403)
        await websocket.close(1008, error.message[:120])
