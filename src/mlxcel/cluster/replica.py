"""One Ray Serve replica: a whole `serve` app in an actor, answering `HttpCall`s (spec X).

The replica parses the same flags through the same startup path as `mlxcel serve` (settings,
`startup.build_process`, `.server_state`, `server.app.create_app`), then runs each call through that ASGI
app in-process: the body goes in as one message, the app's response messages come back as a
`ResponseStart` and body chunks, so bodies, status codes, envelopes and SSE frames are the
app's own. Auth happened at the entry point; the replica's app has no keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from mlxcel.cluster.wire import HttpCall, ResponseStart

if TYPE_CHECKING:
    from mlxcel.command_line import ServeSettings

log = logging.getLogger("mlxcel.cluster")

APP_DRAIN_S = 10.0  # after the caller left, how long the app gets to abort its request and finish


class EngineReplica:
    """The deployment class; Ray Serve makes each replica one actor holding one engine."""

    def __init__(self, argv: Sequence[str], is_loopback: bool = False) -> None:
        from ray import serve

        if is_loopback:
            _bind_serve_grpc_to_loopback()
        from mlxcel.command_line import configure_logging
        from mlxcel.server.app import create_app
        from mlxcel.startup import build_process, server_state  # serve's own startup path (A6)

        settings = replica_settings(argv)
        configure_logging(settings.verbose, None)
        process = build_process(settings)
        self._closers = [stop for _, stop in process.stoppers()]
        self.state, _ = server_state(process, settings)
        self.app = create_app(self.state)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        log.info("replica %s ready", self.replica_id)

    async def handle(self, call: HttpCall) -> AsyncIterator[ResponseStart | bytes]:
        """Run one call through the app; yields the start, then each body chunk as the app sends it."""
        messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        caller_gone = asyncio.Event()
        task = asyncio.ensure_future(self.app(_scope(call), _receive(call.body, caller_gone), messages.put))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = tuple((bytes(k), bytes(v)) for k, v in message.get("headers", ()))
                    yield ResponseStart(message["status"], headers, self.replica_id)
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield bytes(message["body"])
                    if not message.get("more_body", False):
                        break
        finally:
            caller_gone.set()  # the app sees http.disconnect: a running generation is aborted (A7)
            await _drain(task)

    def check_health(self) -> None:
        """Ray's periodic probe: a replica whose engine thread died is restarted."""
        served = self.state.served
        if served is not None and not served.engine.core._thread.is_alive() and not self.state.is_shutting_down:
            raise RuntimeError("the engine thread is not running")

    def __del__(self) -> None:
        self.state.is_shutting_down = True
        for close in getattr(self, "_closers", ()):
            close(10.0)


def _bind_serve_grpc_to_loopback() -> None:
    """NOTE: Ray Serve binds each replica's inter-deployment gRPC server to [::] (every interface),
    with no option; on a local cluster it must listen on loopback like the rest of Ray."""
    from ray.serve._private import replica as serve_replica

    bind = serve_replica.add_port_to_grpc_server

    def bind_loopback(server: Any, address: str) -> int:
        return bind(server, address.replace("[::]:", "127.0.0.1:", 1))

    serve_replica.add_port_to_grpc_server = bind_loopback  # read once, right after this constructor


def replica_settings(argv: Sequence[str]) -> ServeSettings:
    """`serve`'s settings from the cluster's serve flags; no API keys (checked at the entry)."""
    from mlxcel.command_line import OPTIONS, resolve_values, serve_parser, serve_settings
    from mlxcel.env import Environment

    environment = Environment.read()
    namespace = serve_parser("mlxcel cluster", "serve").parse_args(list(argv))
    settings = serve_settings(resolve_values(namespace, OPTIONS, environment), environment)
    return replace(settings, server=replace(settings.server, api_keys=()))


def _scope(call: HttpCall) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": call.method, "scheme": "http", "path": call.path, "raw_path": call.path.encode("utf-8"),
            "query_string": call.query, "root_path": "", "headers": list(call.headers),
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}


def _receive(body: bytes, caller_gone: asyncio.Event) -> Any:
    is_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal is_sent
        if not is_sent:
            is_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await caller_gone.wait()
        return {"type": "http.disconnect"}

    return receive


async def _drain(task: asyncio.Future[None]) -> None:
    with contextlib.suppress(BaseException):
        await asyncio.wait_for(asyncio.shield(task), APP_DRAIN_S)
    if not task.done():
        task.cancel()
