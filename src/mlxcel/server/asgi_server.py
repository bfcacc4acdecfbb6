"""uvicorn for an ASGI app that is not `create_app`'s: the cluster's entry point (spec X).

The same listening line (A4) and signal handling (A7) as `lifecycle.HttpServer`: a signal
stops accepting and returns from `run` (uvicorn would re-raise it after a clean exit), so the
caller can stop what it started (for the cluster: the replicas and the local Ray cluster).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from typing import Any

import uvicorn

from mlxcel.server.lifecycle import LISTENING_PREFIX, handled_signals, listen_address

log = logging.getLogger("mlxcel.server")


class AsgiServer(uvicorn.Server):
    def __init__(self, app: Any, sock: socket.socket, shutdown_timeout_s: float) -> None:
        super().__init__(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                        timeout_graceful_shutdown=int(shutdown_timeout_s)))
        self.sock = sock
        self.address = listen_address(sock)

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return handled_signals(self._handle_signal)

    def _handle_signal(self, sig: int, frame: object) -> None:
        log.info("%s received: shutting down", signal.Signals(sig).name)
        self.force_exit = self.should_exit  # a second signal: stop waiting for open connections
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if not self.should_exit:
            log.info("%s%s", LISTENING_PREFIX, self.address)

    def run_blocking(self) -> None:
        self.run(sockets=[self.sock])
