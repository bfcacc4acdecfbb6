"""Test helpers for the media tests: a tiny real HTTP server on 127.0.0.1 port 0, an httpx
transport that connects only to loopback, and the exception the network guard raises."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.netguard import NonLoopbackAccess, is_loopback


# ---------------------------------------------------------------- loopback HTTP server


@dataclass(frozen=True)
class Reply:
    """A canned HTTP/1.1 response."""

    status: int = 200
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    content_length: bool = True

    def encode(self) -> bytes:
        lines = [f"HTTP/1.1 {self.status} Status", "Connection: close"]
        lines += [f"{name}: {value}" for name, value in self.headers]
        if self.content_length:
            lines.append(f"Content-Length: {len(self.body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.body


Handler = Callable[[asyncio.StreamWriter], Awaitable[None]]


@dataclass(frozen=True)
class SeenRequest:
    target: str
    headers: dict[str, str]


@dataclass
class LoopbackServer:
    """A real HTTP server on 127.0.0.1 port 0; routes map a request target to a Reply or a handler."""

    routes: dict[str, Reply | Handler]
    requests: list[SeenRequest] = field(default_factory=list)
    port: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    async def __aenter__(self) -> LoopbackServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    def url(self, target: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{target}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._serve_one(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self._tasks.discard(task)

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        request_line, *header_lines = head.strip().split("\r\n")
        target = request_line.split(" ")[1]
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
        self.requests.append(SeenRequest(target, headers))
        route = self.routes.get(target, Reply(404, b"not found"))
        if isinstance(route, Reply):
            writer.write(route.encode())
            await writer.drain()
        else:
            await route(writer)


# ---------------------------------------------------------------- loopback-only transport


class _AliasedPeer:
    """Wraps a network stream so `server_addr` reports the address the client meant to reach."""

    def __init__(self, stream: Any, address: str) -> None:
        self._stream = stream
        self._address = address

    def get_extra_info(self, info: str) -> Any:
        if info == "server_addr":
            return (self._address, self._stream.get_extra_info("server_addr")[1])
        return self._stream.get_extra_info(info)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class LoopbackOnlyTransport(httpx.AsyncBaseTransport):
    """Connects only to loopback. `aliases` maps pretend-public addresses onto 127.0.0.1 (the test
    stand-in for the internet); with `report_alias_as_peer`, the response claims its peer was
    the alias, as if the public host had really answered."""

    def __init__(self, aliases: dict[str, str] | None = None, *, report_alias_as_peer: bool = False) -> None:
        self.aliases = aliases or {}
        self.report_alias_as_peer = report_alias_as_peer
        self.hosts: list[str] = []
        self._inner = httpx.AsyncHTTPTransport(retries=0)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        self.hosts.append(host)
        target = self.aliases.get(host, host)
        if not is_loopback(target):
            raise NonLoopbackAccess(f"transport asked to connect to non-loopback {host!r}")
        request.url = request.url.copy_with(host=target)
        response = await self._inner.handle_async_request(request)
        if self.report_alias_as_peer and host in self.aliases:
            response.extensions["network_stream"] = _AliasedPeer(response.extensions["network_stream"], host)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()
