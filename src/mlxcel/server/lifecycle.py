"""Binding, serving and shutting down (A4, A6, A7).

`bind_socket` makes the listening socket itself (TCP, port 0, or a Unix socket) so the real
address is known and logged in one parseable line:

    mlxcel listening on http://127.0.0.1:43117
    mlxcel listening on unix:/run/mlxcel.sock

`serve` runs uvicorn until SIGINT/SIGTERM; the signal marks the server as shutting down and
aborts every in-flight request at once (streams end with finish_reason "abort"), then every
worker is joined within one deadline. `serve` returns 0 only when all of them exited in time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from mlxcel.server.app import create_app
from mlxcel.server.config import ServerConfig
from mlxcel.server.state import ServerState

log = logging.getLogger("mlxcel.server")

LISTENING_PREFIX = "mlxcel listening on "
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True, slots=True)
class Worker:
    """Something to join at shutdown: a name for the log and `stop(timeout) -> exited in time`."""

    name: str
    stop: Callable[[float], bool]


def bind_socket(config: ServerConfig) -> socket.socket:
    """A listening socket for --host/--port, or for the Unix socket path --host names (A4)."""
    if config.is_unix_socket:
        return _bind_unix(Path(config.host))
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind {config.host}:{config.port}: {exc.strerror}") from None
    sock.listen(2048)
    return sock


def _bind_unix(path: Path) -> socket.socket:
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise OSError(f"--host {path}: exists and is not a socket; refusing to replace it")
        path.unlink()  # a stale socket from an earlier run
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(2048)
    return sock


def listen_address(sock: socket.socket) -> str:
    """The URL clients use: http://host:port (IPv6 in brackets) or unix:/path."""
    if sock.family == socket.AF_UNIX:
        return f"unix:{sock.getsockname()}"
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@contextlib.contextmanager
def handled_signals(handler: Callable[[int, object], None]) -> Generator[None, None, None]:
    """SIGINT/SIGTERM go to `handler` while the block runs; a no-op off the main thread (signals
    reach only the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in HANDLED_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class HttpServer(uvicorn.Server):
    """uvicorn with mlxcel's signal handling (A7) and listening line (A4).

    uvicorn re-raises a captured signal after a graceful exit, which would turn a clean
    shutdown into death by SIGTERM; we handle the signal ourselves and return instead.
    """

    def __init__(self, state: ServerState, sock: socket.socket, *, on_shutdown: Callable[[], None],
                 exits_on_engine_failure: bool = False) -> None:
        tls = state.config
        # NOTE: h11, not httptools: uvicorn's httptools protocol lowercases every response header
        # name, and llama-server clients read `Process-Start-Time-Unix` on /metrics case-sensitively.
        config = uvicorn.Config(create_app(state), log_config=None, access_log=False, lifespan="off", http="h11",
                                timeout_graceful_shutdown=int(state.config.shutdown_timeout_s),
                                ssl_keyfile=str(tls.ssl_keyfile) if tls.ssl_keyfile else None,
                                ssl_certfile=str(tls.ssl_certfile) if tls.ssl_certfile else None)
        super().__init__(config)
        self.state = state
        self.sock = sock
        self.address = listen_address(sock)
        if tls.is_tls:
            self.address = self.address.replace("http://", "https://", 1)
        self._on_shutdown = on_shutdown
        self._exits_on_engine_failure = exits_on_engine_failure  # serve(): a dead engine ends the process

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return handled_signals(self._handle_signal)  # in a thread, its owner calls request_shutdown()

    def _handle_signal(self, sig: int, frame: object) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for connections
        log.info("%s received: shutting down", signal.Signals(sig).name)
        self.request_shutdown()

    def request_shutdown(self) -> None:
        """Refuse new work, abort in-flight requests, stop accepting connections."""
        if not self.state.is_shutting_down:
            self.state.is_shutting_down = True
            self._on_shutdown()
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._exits_on_engine_failure and not self.should_exit and self.state.engine_failed():
            log.critical("the engine loop died: shutting down with exit code 1")
            self.request_shutdown()
        return await super().on_tick(counter)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if not self.should_exit:
            log.info("%s%s", LISTENING_PREFIX, self.address)

    def run_blocking(self) -> None:
        self.run(sockets=[self.sock])


def join_workers(workers: Sequence[Worker], deadline_s: float) -> bool:
    """Join every worker within one shared deadline; log each one still running (A7)."""
    end = time.monotonic() + deadline_s
    is_clean = True
    for worker in workers:
        if not worker.stop(max(end - time.monotonic(), 0.0)):
            log.error("worker %r still running at the %.0f s shutdown deadline", worker.name, deadline_s)
            is_clean = False
    return is_clean


def serve(state: ServerState, sock: socket.socket, workers: Sequence[Worker]) -> int:
    """Serve until a signal, then abort, join and return the exit code (0 = clean, A7)."""
    server = HttpServer(state, sock, on_shutdown=lambda: _abort_in_flight(workers), exits_on_engine_failure=True)
    try:
        server.run_blocking()
    finally:
        is_clean = join_workers(workers, state.config.shutdown_timeout_s)
        _close_listener(sock, server.address)
    if is_clean:
        log.info("shutdown complete")
    return 0 if is_clean and not state.engine_failed() else 1


def _abort_in_flight(workers: Sequence[Worker]) -> None:
    for worker in workers:
        worker.stop(0.0)  # non-blocking: the owner thread aborts its requests and exits on its own


def _close_listener(sock: socket.socket, address: str) -> None:
    """Close the socket and remove a Unix socket's file (uvicorn may have closed the socket already)."""
    sock.close()
    if address.startswith("unix:"):
        with contextlib.suppress(OSError):
            os.unlink(address.removeprefix("unix:"))


class ServerThread:
    """The HTTP server on a background thread (tests, embedding in another program).

    The caller owns the workers: `stop()` ends the HTTP server only.
    """

    def __init__(self, state: ServerState, sock: socket.socket | None = None) -> None:
        self.sock = sock or bind_socket(state.config)
        self.server = HttpServer(state, self.sock, on_shutdown=lambda: None)
        self.address = self.server.address
        self._thread = threading.Thread(target=self.server.run_blocking, name="mlxcel-http", daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        end = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        _close_listener(self.sock, self.address)
