"""Browser-facing edges of every route: the Origin policy and CORS (C6), the route prefix (A11).

`OriginPolicy` is the one answer to "may this browser origin call us": with --cors-origins /
--allowed-origins, the listed origins (or `*`); without, only the server's own origin. A client
that sends no Origin (curl, SDKs) is never refused. `Cors` applies the policy to HTTP when one
is configured: a disallowed origin gets 403, a preflight is answered, replies carry the headers.
`PrefixMount` serves every route, WebSocket included, under --api-prefix and nothing outside it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from mlxcel.api.errors import ApiError, error_body

ALLOWED_METHODS = "GET, POST, PUT, PATCH, DELETE, OPTIONS"
PREFLIGHT_MAX_AGE_S = "600"


def parse_origins(values: Iterable[str]) -> tuple[str, ...]:
    """Comma-separated origins from each flag value, trailing slashes dropped; ValueError on a bad one."""
    origins = []
    for value in values:
        for item in (part.strip().rstrip("/") for part in value.split(",")):
            if not item:
                continue
            if item != "*" and not item.startswith(("http://", "https://")):
                raise ValueError(f"--cors-origins: {item!r} is not an origin (http(s)://host[:port], or *)")
            origins.append(item)
    return tuple(origins)


@dataclass(frozen=True, slots=True)
class OriginPolicy:
    allowed: tuple[str, ...] | None = None  # None: only the server's own origin

    def is_allowed(self, origin: str, host: str) -> bool:
        origin = origin.rstrip("/")
        if self.allowed is not None and ("*" in self.allowed or origin in self.allowed):
            return True
        return origin in (f"http://{host}", f"https://{host}")  # same origin is always fine

    def refusal(self, headers: Headers, what: str) -> ApiError | None:
        """403 for a browser origin the policy does not allow; None when allowed or no Origin was sent."""
        origin = headers.get("origin")
        if origin is None or self.is_allowed(origin, headers.get("host", "")):
            return None
        return ApiError(403, f"Origin {origin} is not allowed to {what} (see --cors-origins)", "forbidden", code=403)


class Cors:
    """C6 over HTTP when a policy is configured (without one, nothing changes for other routes)."""

    def __init__(self, app: ASGIApp, *, policy: OriginPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if origin is None:
            await self.app(scope, receive, send)
            return
        refusal = self.policy.refusal(headers, "call this server")
        if refusal is not None:
            await JSONResponse(error_body(refusal), 403)(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await self._preflight(origin, headers)(scope, receive, send)
            return
        await self.app(scope, receive, _with_cors_headers(send, self._allow_origin(origin)))

    def _allow_origin(self, origin: str) -> str:
        return "*" if self.policy.allowed == ("*",) else origin

    def _preflight(self, origin: str, headers: Headers) -> Response:
        requested = headers.get("access-control-request-headers", "authorization, content-type, x-api-key")
        return Response(status_code=204, headers={
            "Access-Control-Allow-Origin": self._allow_origin(origin), "Access-Control-Allow-Methods": ALLOWED_METHODS,
            "Access-Control-Allow-Headers": requested, "Access-Control-Max-Age": PREFLIGHT_MAX_AGE_S,
            "Vary": "Origin"})


def _with_cors_headers(send: Send, allow_origin: str) -> Send:
    async def wrapped(message: dict) -> None:  # type: ignore[type-arg]
        if message["type"] == "http.response.start":
            extra = [(b"access-control-allow-origin", allow_origin.encode()), (b"vary", b"Origin"),
                     (b"access-control-expose-headers", b"*")]
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return wrapped


class PrefixMount:
    """A11: `/PREFIX/x` reaches route `/x`; anything outside the prefix is a 404 (HTTP) or refused (WebSocket)."""

    def __init__(self, app: ASGIApp, *, prefix: str) -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path != self.prefix and not path.startswith(self.prefix + "/"):
            await self._not_found(scope, receive, send)
            return
        inner = path[len(self.prefix):] or "/"
        # root_path stays as it is: Starlette would strip it again from a route path that starts with it
        scope = {**scope, "path": inner, "raw_path": inner.encode()}
        await self.app(scope, receive, send)

    async def _not_found(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        error = ApiError(404, f"{scope['method']} {scope['path']}: Not Found (this server's routes are under "
                         f"{self.prefix}/)", "not_found_error", code=404)
        await JSONResponse(error_body(error), 404)(scope, receive, send)
