"""Loading tests never leave the machine: an autouse guard makes any connect to, or name lookup
of, a non-loopback host raise and fail the test. The fake hub fixture serves tiny repos on
127.0.0.1 and points huggingface_hub at it (A2)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from .fake_hub import FakeHub, FakeRepo, hub_serving
from .netguard import NonLoopbackAccess, is_loopback
from .tiny_checkpoint import tiny_llama_files


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    violations: list[str] = []
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def check(what: str, host: Any) -> None:
        if not is_loopback(host):
            violations.append(f"{what} {host!r}")
            raise NonLoopbackAccess(f"test tried to {what} non-loopback host {host!r}")

    def connect(self: socket.socket, address: Any) -> None:
        if isinstance(address, tuple):
            check("connect to", address[0])
        return real_connect(self, address)

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        check("resolve", host)
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield violations
    assert not violations, f"non-loopback network access attempted: {violations}"


@pytest.fixture(scope="session")
def tiny_llama() -> dict[str, bytes]:
    """The files of a tiny random llama repo (HF layout)."""
    return tiny_llama_files()


@pytest.fixture
def fake_hub(tiny_llama: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A hub on 127.0.0.1 knowing `acme/tiny-llama` and `mlx-community/tiny-llama`; huggingface_hub
    in this process is pointed at it (it read HF_ENDPOINT at import, so its constants are patched)."""
    repos = {"acme/tiny-llama": FakeRepo(tiny_llama), "mlx-community/tiny-llama": FakeRepo(tiny_llama)}
    with hub_serving(repos, monkeypatch) as hub:
        yield hub
