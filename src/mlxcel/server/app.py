"""The app factory: the routes table mounted on FastAPI, behind the Gate (auth, body size, timeouts)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from mlxcel.api.errors import ApiError, invalid_request
from mlxcel.server.cors import Cors, OriginPolicy, PrefixMount
from mlxcel.server.gate import Gate
from mlxcel.server.image_routes import IMAGE_ROUTES
from mlxcel.server.realtime import REALTIME_PATHS, realtime_endpoint
from mlxcel.server.responses import error_response, internal_error
from mlxcel.server.routes import ROUTES, Route, bind, public_paths
from mlxcel.server.state import ServerState
from mlxcel.server.ui_api import ui_api_routes
from mlxcel.server.webui import webui_routes

_HTTP_ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error"}


def create_app(state: ServerState, routes: tuple[Route, ...] = ROUTES) -> FastAPI:
    """One app per server; all its state lives in `state` (app.state.mlxcel)."""
    app = FastAPI(title="mlxcel", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.mlxcel = state
    if state.side.image is not None:  # spec J: the image routes exist only with a loaded --image-model
        routes = routes + IMAGE_ROUTES
    app.state.api_routes = routes  # what /openapi.json describes: the API as this process serves it
    if state.config.webui:  # A5: the UI and its control plane, on the same listener
        routes = routes + webui_routes() + ui_api_routes()
    for route in routes:
        endpoint = bind(route, state)
        for path in route.paths:
            app.add_api_route(path, endpoint, methods=list(route.methods), include_in_schema=False)
    if state.realtime is not None:  # spec H: mounted only in a realtime process
        for path in REALTIME_PATHS:
            app.router.add_websocket_route(path, realtime_endpoint(state.config, state.realtime))
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unhandled)
    config = state.config
    app.add_middleware(Gate, api_keys=config.api_keys, public_paths=public_paths(routes),
                       max_body_bytes=config.max_body_bytes, timeout_s=config.timeout_s)
    if config.cors_origins is not None:  # C6, outside the Gate: a preflight carries no key
        app.add_middleware(Cors, policy=OriginPolicy(config.cors_origins))
    if config.api_prefix:  # A11: outermost, so every route (and the WebSocket) sits under the prefix
        app.add_middleware(PrefixMount, prefix=config.api_prefix)
    return app


async def _http_error(request: Request, exc: Exception) -> Response:
    """Unknown path (404) or method (405), in the OpenAI envelope instead of {"detail": ...}."""
    assert isinstance(exc, HTTPException)
    kind = _HTTP_ERROR_TYPES.get(exc.status_code, "invalid_request_error")
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return error_response(ApiError(exc.status_code, message, kind, code=exc.status_code,
                                   headers=dict(exc.headers or {})))


async def _validation_error(request: Request, exc: Exception) -> Response:
    return error_response(invalid_request(str(exc)))  # routes parse bodies themselves; never a 422


async def _unhandled(request: Request, exc: Exception) -> Response:
    return internal_error(exc)
