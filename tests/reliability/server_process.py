"""A real `mlxcel-server` process on 127.0.0.1 port 0 for the fault tests (kill -9, SIGTERM, restart)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

from mlxcel.server.lifecycle import LISTENING_PREFIX

ADDRESS = re.compile(re.escape(LISTENING_PREFIX) + r"(\S+)")
SERVER_COMMAND = [sys.executable, "-c", "import sys; from mlxcel.cli import server_main; sys.exit(server_main())"]


class ServerProcess:
    """`mlxcel-server --port 0 ARGS`; `address` once it listens, `startup_s` how long that took."""

    def __init__(self, *args: str) -> None:
        self.log: list[str] = []
        started = time.monotonic()
        self.process = subprocess.Popen([*SERVER_COMMAND, "--port", "0", "--no-warmup", *args],
                                        env={**os.environ}, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                        text=True)
        self.address = self._read_address(timeout=180.0)
        self.startup_s = time.monotonic() - started

    def _read_address(self, timeout: float) -> str:
        end = time.monotonic() + timeout
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line)
            match = ADDRESS.search(line)
            if match:
                threading.Thread(target=self._drain, daemon=True).start()
                return match.group(1)
            if time.monotonic() > end:
                break
        self.kill()
        raise AssertionError("no listening line:\n" + "".join(self.log))

    def _drain(self) -> None:
        assert self.process.stderr is not None
        self.log.extend(self.process.stderr)

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.address, timeout=timeout)

    def kill(self) -> None:
        """kill -9: no shutdown path runs at all."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def terminate(self, timeout: float) -> tuple[int, float]:
        """SIGTERM; (exit code, seconds until it exited)."""
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=timeout)
        return code, time.monotonic() - started

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.kill()
