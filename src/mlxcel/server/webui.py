"""`--webui` (A5): the listener rules, the one-time session key and the static UI at /webui/.

The UI's files ship inside the package (`server/webui/`: plain HTML, CSS and JS, no build
step, nothing from a CDN). They are public, like a login page: everything they do goes
through `/ui-api/v1` and the API routes, which need the key.
"""

from __future__ import annotations

import ipaddress
import secrets
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, RedirectResponse, Response

from mlxcel.server.config import ServerConfig
from mlxcel.server.routes import Route
from mlxcel.server.state import ServerState

WEBUI_DIR = Path(__file__).with_name("webui")
_CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                  ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
            "Referrer-Policy": "no-referrer",
            "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_listener(config: ServerConfig) -> None:
    """A5's refusals: a Unix socket, or a non-loopback listener without an API key and TLS."""
    if not config.webui:
        return
    if config.is_unix_socket:
        raise ValueError(f"--webui cannot serve on the Unix socket {config.host}: listen on a loopback TCP "
                         "address (the default --host 127.0.0.1) for the web UI")
    if is_loopback(config.host):
        return
    missing = [what for what, is_set in (("--api-key", config.api_keys), ("--ssl-key-file and --ssl-cert-file",
               config.is_tls)) if not is_set]
    if missing:
        raise ValueError(f"--webui on the non-loopback address {config.host} needs {' and '.join(missing)}: "
                         "the control plane must not be open on the network")


def new_session_key() -> str:
    return "mlxcel-ui-" + secrets.token_urlsafe(24)


def needs_session_key(config: ServerConfig) -> bool:
    """A loopback --webui without --api-key gets a one-time key for /ui-api/v1."""
    return config.webui and not config.api_keys


def _asset_paths() -> dict[str, Path]:
    return {f"/webui/{p.name}": p for p in sorted(WEBUI_DIR.iterdir()) if p.suffix in _CONTENT_TYPES}


async def _asset(request: Request, state: ServerState) -> Response:
    path = _asset_paths()[request.scope["path"]]  # the path inside --api-prefix (PrefixMount strips it)
    return FileResponse(path, media_type=_CONTENT_TYPES[path.suffix], headers=_HEADERS)


async def _index(request: Request, state: ServerState) -> Response:
    path = WEBUI_DIR / "index.html"
    return FileResponse(path, media_type=_CONTENT_TYPES[".html"], headers=_HEADERS)


async def _to_index(request: Request, state: ServerState) -> Response:
    return RedirectResponse(f"{state.config.api_prefix}/webui/", 308)


def webui_routes() -> tuple[Route, ...]:
    """/webui (redirect), /webui/ and each file of the UI, all public (exact paths: the Gate's rule)."""
    assets = tuple(path for path in _asset_paths() if path != "/webui/index.html")
    return (Route(("/webui",), ("GET",), _to_index, is_public=True),
            Route(("/webui/", "/webui/index.html"), ("GET",), _index, is_public=True),
            Route(assets, ("GET",), _asset, is_public=True))
