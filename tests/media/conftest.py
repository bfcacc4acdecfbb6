"""Media tests share one autouse guard: any connect to, or name lookup of, a non-loopback host
raises and fails the test (spec C3 tests must never leave the machine)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from media_net import NonLoopbackAccess, is_loopback


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Make socket connects and name lookups to anything but loopback raise and be recorded."""
    violations: list[str] = []
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_getaddrinfo = socket.getaddrinfo

    def check(what: str, host: Any) -> None:
        if not is_loopback(host):
            violations.append(f"{what} {host!r}")
            raise NonLoopbackAccess(f"test tried to {what} non-loopback host {host!r}")

    def connect(self: socket.socket, address: Any) -> None:
        if isinstance(address, tuple):
            check("connect to", address[0])
        return real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        if isinstance(address, tuple):
            check("connect to", address[0])
        return real_connect_ex(self, address)

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        check("resolve", host)
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield violations
    assert not violations, f"non-loopback network access attempted: {violations}"
