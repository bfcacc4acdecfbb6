"""C3/C4: SSRF-safe remote fetch against real HTTP servers on 127.0.0.1.

"Public" hosts are played by 93.184.216.34, which the test transport maps onto the loopback
server; nothing here connects anywhere but loopback (the autouse guard in conftest proves it).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from mlxcel.media.errors import MediaError, Reason
from mlxcel.media.fetch import _pinned_request, fetch_remote_media, parse_remote_url
from mlxcel.media.limits import MediaPolicy

from media_net import LoopbackOnlyTransport, LoopbackServer, NonLoopbackAccess, Reply

PUBLIC_IP = "93.184.216.34"
BODY = b"\x89PNG-pretend-image-bytes"
STRICT = MediaPolicy()
OPEN = MediaPolicy(allow_private_urls=True)


def static_resolver(answers: dict[str, Sequence[str]]) -> Any:
    calls: list[str] = []

    async def resolve(host: str, port: int) -> Sequence[str]:
        calls.append(host)
        if host not in answers:
            raise socket.gaierror(f"stub resolver has no answer for {host}")
        return answers[host]

    resolve.calls = calls  # type: ignore[attr-defined]
    return resolve


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def fetch(url: str, policy: MediaPolicy = STRICT, *, max_bytes: int = 1 << 20, **kwargs: Any) -> bytes:
    return await fetch_remote_media(url, policy, max_bytes=max_bytes, **kwargs)


# ---------------------------------------------------------------- refused before any request


BLOCKED_URLS = [
    "http://127.0.0.1:{port}/img",
    "http://localhost:{port}/img",
    "http://2130706433:{port}/img",
    "http://0x7f.1:{port}/img",
    "http://0x7f000001:{port}/img",
    "http://0177.0.0.1:{port}/img",
    "http://127.1:{port}/img",
    "http://[::1]:{port}/img",
    "http://[::ffff:127.0.0.1]:{port}/img",
    "http://[::ffff:7f00:1]:{port}/img",
    "http://[::127.0.0.1]:{port}/img",
    "http://[64:ff9b::7f00:1]:{port}/img",
    "http://169.254.169.254/latest/meta-data/",
    "http://[::ffff:169.254.169.254]/latest/meta-data/",
    "http://2852039166/latest/meta-data/",
    "http://10.0.0.1/img",
    "http://172.16.5.4/img",
    "http://192.168.0.1/img",
    "http://100.64.0.1/img",
    "http://192.0.0.1/img",
    "http://198.18.0.1/img",
    "http://192.0.2.1/img",
    "http://240.0.0.1/img",
    "http://255.255.255.255/img",
    "http://224.0.0.1/img",
    "http://0.0.0.0:{port}/img",
    "http://[fd00::1]/img",
    "http://[fe80::1%25eth0]/img",
    "http://[2001:db8::1]/img",
    "HTTP://127.0.0.1:{port}/img",
]


@pytest.mark.parametrize("template", BLOCKED_URLS)
def test_c3_blocked_hosts_are_refused_and_never_fetched(template: str) -> None:
    async def scenario() -> None:
        async with LoopbackServer({"/img": Reply(body=BODY)}) as server:
            transport = LoopbackOnlyTransport()
            with pytest.raises(MediaError) as caught:
                await fetch(template.format(port=server.port), transport=transport)
            assert caught.value.reason_code is Reason.BLOCKED_ADDRESS
            assert server.requests == []
            assert transport.hosts == []

    run(scenario())


@pytest.mark.parametrize(
    "answers",
    [
        ["127.0.0.1"],
        ["10.1.2.3"],
        ["169.254.169.254"],
        ["::1"],
        ["::ffff:127.0.0.1"],
        ["fe80::1%eth0"],
        [PUBLIC_IP, "127.0.0.1"],  # any blocked answer refuses the host
        ["2606:4700::1111", "fd00::5"],
    ],
)
def test_c3_every_resolved_address_must_be_public(answers: list[str]) -> None:
    resolver = static_resolver({"media.example": answers})
    transport = LoopbackOnlyTransport()
    with pytest.raises(MediaError) as caught:
        run(fetch("http://media.example/img", resolver=resolver, transport=transport))
    assert caught.value.reason_code is Reason.BLOCKED_ADDRESS
    assert "resolves to" in caught.value.message
    assert transport.hosts == []


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("ftp://media.example/img", Reason.UNSUPPORTED_SCHEME),
        ("file:///etc/passwd", Reason.UNSUPPORTED_SCHEME),
        ("gopher://media.example/", Reason.UNSUPPORTED_SCHEME),
        ("javascript:alert(1)", Reason.UNSUPPORTED_SCHEME),
        ("http://user:secret@media.example/img", Reason.URL_CREDENTIALS),
        ("http://user@media.example/img", Reason.URL_CREDENTIALS),
        ("http://@media.example/img", Reason.URL_CREDENTIALS),
        ("http://127.0.0.1\\@media.example/img", Reason.URL_CREDENTIALS),
        ("http:///img", Reason.INVALID_URL),
        ("http://media.example:99999/img", Reason.INVALID_URL),
        ("http://1.2.3.4.5/img", Reason.INVALID_URL),
        ("http://08.1.1.1/img", Reason.INVALID_URL),
        ("http://[::g]/img", Reason.INVALID_URL),
    ],
)
def test_c3_scheme_credentials_and_malformed_hosts(url: str, reason: Reason) -> None:
    resolver = static_resolver({"media.example": [PUBLIC_IP]})
    transport = LoopbackOnlyTransport({PUBLIC_IP: "127.0.0.1"})
    with pytest.raises(MediaError) as caught:
        run(fetch(url, resolver=resolver, transport=transport))
    assert caught.value.reason_code is reason
    assert resolver.calls == []
    assert transport.hosts == []


# ---------------------------------------------------------------- pinning, redirects, peer


def test_c3_public_host_is_fetched_from_the_vetted_address_with_its_host_header() -> None:
    async def scenario() -> None:
        async with LoopbackServer({"/img": Reply(body=BODY)}) as server:
            resolver = static_resolver({"media.example": [PUBLIC_IP]})
            transport = LoopbackOnlyTransport({PUBLIC_IP: "127.0.0.1"}, report_alias_as_peer=True)
            url = f"http://media.example:{server.port}/img"
            body = await fetch(url, resolver=resolver, transport=transport)
            assert body == BODY
            assert transport.hosts == [PUBLIC_IP]  # connected to the pinned address, not the name
            assert server.requests[0].headers["host"] == f"media.example:{server.port}"
            assert server.requests[0].headers["accept-encoding"] == "identity"

    run(scenario())


def test_c3_https_requests_keep_the_name_for_sni() -> None:
    url = parse_remote_url("https://Media.Example:8443/a.png?x=1")
    client = httpx.AsyncClient()
    request = _pinned_request(client, url, ipaddress.ip_address(PUBLIC_IP))
    assert request.url.host == PUBLIC_IP
    assert request.url.port == 8443
    assert request.headers["host"] == "media.example:8443"
    assert request.extensions["sni_hostname"] == "media.example"
    run(client.aclose())


@pytest.mark.parametrize(
    ("location", "answers"),
    [
        ("http://10.1.2.3/secret", {}),
        ("http://127.0.0.1:{port}/secret", {}),
        ("http://[::1]:{port}/secret", {}),
        ("http://0x7f.1:{port}/secret", {}),
        ("http://169.254.169.254/latest/meta-data/", {}),
        ("http://internal.example/secret", {"internal.example": ["192.168.1.20"]}),
        ("//internal.example/secret", {"internal.example": ["127.0.0.1"]}),
    ],
)
def test_c3_redirect_into_private_space_is_refused(location: str, answers: dict[str, list[str]]) -> None:
    async def scenario() -> None:
        routes = {"/start": Reply(302), "/secret": Reply(body=b"private")}
        async with LoopbackServer(routes) as server:
            routes["/start"] = Reply(302, headers=(("Location", location.format(port=server.port)),))
            resolver = static_resolver({"media.example": [PUBLIC_IP], **answers})
            transport = LoopbackOnlyTransport({PUBLIC_IP: "127.0.0.1"}, report_alias_as_peer=True)
            with pytest.raises(MediaError) as caught:
                url = f"http://media.example:{server.port}/start"
                await fetch(url, resolver=resolver, transport=transport)
            assert caught.value.reason_code is Reason.BLOCKED_ADDRESS
            assert [r.target for r in server.requests] == ["/start"]
            assert transport.hosts == [PUBLIC_IP]

    run(scenario())


def test_c3_redirect_to_another_scheme_is_refused() -> None:
    async def scenario() -> None:
        routes = {"/start": Reply(301, headers=(("Location", "file:///etc/passwd"),))}
        async with LoopbackServer(routes) as server:
            with pytest.raises(MediaError) as caught:
                await fetch(server.url("/start"), OPEN)
            assert caught.value.reason_code is Reason.UNSUPPORTED_SCHEME

    run(scenario())


@pytest.mark.parametrize(("num_redirects", "ok"), [(5, True), (6, False)])
def test_c3_at_most_five_redirect_hops(num_redirects: int, ok: bool) -> None:
    async def scenario() -> None:
        routes: dict[str, Any] = {
            f"/r{i}": Reply(307, headers=(("Location", f"/r{i + 1}"),)) for i in range(num_redirects)
        }
        routes[f"/r{num_redirects}"] = Reply(body=BODY)
        async with LoopbackServer(routes) as server:
            resolver = static_resolver({"media.example": [PUBLIC_IP]})
            transport = LoopbackOnlyTransport({PUBLIC_IP: "127.0.0.1"}, report_alias_as_peer=True)
            result = fetch(f"http://media.example:{server.port}/r0", resolver=resolver, transport=transport)
            if ok:
                assert await result == BODY
                assert len(resolver.calls) == num_redirects + 1  # every hop re-resolved and re-checked
            else:
                with pytest.raises(MediaError) as caught:
                    await result
                assert caught.value.reason_code is Reason.TOO_MANY_REDIRECTS
                assert len(server.requests) == 6

    run(scenario())


def test_c3_dns_rebinding_is_caught_by_the_peer_check_before_the_body() -> None:
    """First answer public, later answers loopback; the connection really lands on loopback."""

    async def slow_body(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)  # the body would only come later; the refusal must not wait for it
        writer.write(b"hello")

    async def scenario() -> None:
        async with LoopbackServer({"/img": slow_body}) as server:
            answers = iter([[PUBLIC_IP], ["127.0.0.1"], ["127.0.0.1"]])

            async def rebinding(host: str, port: int) -> list[str]:
                return next(answers)

            # The "public" address is routed to the loopback server and the peer is reported as it is.
            transport = LoopbackOnlyTransport({PUBLIC_IP: "127.0.0.1"})
            started = time.monotonic()
            with pytest.raises(MediaError) as caught:
                url = f"http://rebind.example:{server.port}/img"
                await fetch(url, resolver=rebinding, transport=transport)
            assert caught.value.reason_code is Reason.BLOCKED_ADDRESS
            assert "connected to peer 127.0.0.1" in caught.value.message
            assert time.monotonic() - started < 2.0
            assert len(server.requests) == 1

    run(scenario())


def test_c3_override_allows_a_loopback_server() -> None:
    async def scenario() -> None:
        routes = {"/img": Reply(body=BODY), "/hop": Reply(302, headers=(("Location", "/img"),))}
        async with LoopbackServer(routes) as server:
            assert await fetch(server.url("/img"), OPEN) == BODY
            assert await fetch(server.url("/hop"), OPEN) == BODY
            assert await fetch(server.url("/img", host="localhost"), OPEN) == BODY  # the real resolver

    run(scenario())


def test_c3_override_keeps_scheme_and_credential_checks() -> None:
    cases = (
        ("ftp://127.0.0.1/x", Reason.UNSUPPORTED_SCHEME),
        ("http://a:b@127.0.0.1/", Reason.URL_CREDENTIALS),
    )
    for url, reason in cases:
        with pytest.raises(MediaError) as caught:
            run(fetch(url, OPEN))
        assert caught.value.reason_code is reason


# ---------------------------------------------------------------- deadline and size cap


@pytest.mark.parametrize("stage", ["headers", "body"])
def test_c4_slow_loris_server_hits_the_deadline(stage: str) -> None:
    async def dribble(writer: asyncio.StreamWriter) -> None:
        if stage == "body":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        for _ in range(1000):
            writer.write(b"x" if stage == "body" else b"X-Slow: 1\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)

    async def scenario() -> None:
        async with LoopbackServer({"/slow": dribble}) as server:
            started = time.monotonic()
            with pytest.raises(MediaError) as caught:
                await fetch(server.url("/slow"), MediaPolicy(allow_private_urls=True, fetch_timeout_s=0.5))
            assert caught.value.reason_code is Reason.FETCH_TIMEOUT
            assert 0.4 < time.monotonic() - started < 3.0

    run(scenario())


def test_c4_declared_oversize_is_refused_before_reading() -> None:
    async def scenario() -> None:
        async with LoopbackServer({"/big": Reply(body=b"x" * 2000)}) as server:
            with pytest.raises(MediaError) as caught:
                await fetch(server.url("/big"), OPEN, max_bytes=1000)
            assert caught.value.reason_code is Reason.PAYLOAD_TOO_LARGE
            assert "declares 2000 bytes" in caught.value.message

    run(scenario())


def test_c4_streamed_oversize_is_refused_as_soon_as_the_cap_is_passed() -> None:
    async def endless(writer: asyncio.StreamWriter) -> None:
        # No Content-Length: send just past the cap, then stall; waiting for the end would time out.
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b"x" * 1001)
        await writer.drain()
        await asyncio.sleep(30)

    async def scenario() -> None:
        async with LoopbackServer({"/endless": endless}) as server:
            with pytest.raises(MediaError) as caught:
                policy = MediaPolicy(allow_private_urls=True, fetch_timeout_s=5)
                await fetch(server.url("/endless"), policy, max_bytes=1000)
            assert caught.value.reason_code is Reason.PAYLOAD_TOO_LARGE
            assert "sent more than 1000 bytes" in caught.value.message

    run(scenario())


@pytest.mark.parametrize(
    ("reply", "words"),
    [
        (Reply(404, b"missing"), "HTTP 404"),
        (Reply(500), "HTTP 500"),
        (Reply(302), "without a Location"),
        (Reply(body=b"\x1f\x8b", headers=(("Content-Encoding", "gzip"),)), "compressed"),
    ],
)
def test_c3_failed_responses(reply: Reply, words: str) -> None:
    async def scenario() -> None:
        async with LoopbackServer({"/x": reply}) as server:
            with pytest.raises(MediaError) as caught:
                await fetch(server.url("/x"), OPEN)
            assert caught.value.reason_code is Reason.FETCH_FAILED
            assert words in caught.value.message

    run(scenario())


def test_c3_unresolvable_host() -> None:
    with pytest.raises(MediaError) as caught:
        url = "http://nowhere.example/x"
        run(fetch(url, resolver=static_resolver({}), transport=LoopbackOnlyTransport()))
    assert caught.value.reason_code is Reason.UNRESOLVABLE_HOST


def test_the_guard_refuses_non_loopback_connections(loopback_only: list[str]) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        with pytest.raises(NonLoopbackAccess):
            sock.connect(("192.0.2.1", 80))
        with pytest.raises(NonLoopbackAccess):
            socket.getaddrinfo("example.com", 80)
    finally:
        sock.close()
    assert loopback_only == ["connect to '192.0.2.1'", "resolve 'example.com'"]
    loopback_only.clear()


def test_the_guard_sits_under_the_real_fetch_path(loopback_only: list[str]) -> None:
    """A public address passes the classifier, so the default transport really tries to connect:
    the guard must be what stops it (so the other tests' silence proves they stayed local)."""
    with pytest.raises((NonLoopbackAccess, BaseExceptionGroup)):
        run(fetch(f"http://{PUBLIC_IP}/img", STRICT))
    assert loopback_only == [f"connect to '{PUBLIC_IP}'"]
    loopback_only.clear()
