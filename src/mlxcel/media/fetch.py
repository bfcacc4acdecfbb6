"""SSRF-safe fetch of remote http(s) media (spec C3, C4).

Addresses are checked at three points: every address the host resolves to (before any
connection), every redirect hop (followed here, at most `max_redirects`), and the peer the
socket actually reached, before one body byte is read, which closes the DNS-rebinding
window. The connection goes to the vetted address (pinned); Host and TLS SNI keep the name.
The whole fetch runs under one deadline and the body is capped while streaming.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import SplitResult, urlsplit, urlunsplit

import httpx

from mlxcel.media.addresses import IPAddress, is_blocked_address, parse_host, parse_ip_literal
from mlxcel.media.errors import MediaError, Reason
from mlxcel.media.limits import MediaPolicy

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""Async `(host, port) -> addresses` (strings as getaddrinfo returns them)."""

_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_USER_AGENT = "mlxcel-media-fetch"


async def default_resolver(host: str, port: int) -> list[str]:
    """Resolve with the system resolver (getaddrinfo runs in the loop's thread pool)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


async def fetch_remote_media(
    url: str,
    policy: MediaPolicy,
    *,
    max_bytes: int,
    resolver: Resolver | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> bytes:
    """Fetch `url` (http/https) and return at most `max_bytes` of body; raises MediaError.

    `resolver` and `transport` are injection points for tests and deployments; a given
    transport is closed when the fetch ends. `policy.allow_private_urls` skips only the
    address checks: scheme, credentials, redirect count, deadline and size cap still apply.
    """
    try:
        async with asyncio.timeout(policy.fetch_timeout_s):
            return await _fetch(url, policy, max_bytes, resolver or default_resolver, transport)
    except TimeoutError:
        raise MediaError(
            f"fetching {_shown(url)} did not finish within {policy.fetch_timeout_s:g} s",
            Reason.FETCH_TIMEOUT,
        ) from None


async def _fetch(
    url: str,
    policy: MediaPolicy,
    max_bytes: int,
    resolver: Resolver,
    transport: httpx.AsyncBaseTransport | None,
) -> bytes:
    current = parse_remote_url(url)
    async with _client(policy, transport) as client:
        for _ in range(policy.max_redirects + 1):
            address = await vet_host(current, policy, resolver)
            body, location = await _request_hop(client, current, address, policy, max_bytes)
            if location is None:
                return body
            current = parse_remote_url(_join(current, location))
    raise MediaError(
        f"fetching {_shown(url)} was redirected more than {policy.max_redirects} times",
        Reason.TOO_MANY_REDIRECTS,
    )


def parse_remote_url(url: str) -> httpx.URL:
    """Check scheme and credentials and normalise an IP host (`0x7f.1` -> `127.0.0.1`)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise MediaError(f"media URL {_shown(url)} is not valid: {exc}", Reason.INVALID_URL) from None
    if parts.scheme.lower() not in _DEFAULT_PORTS:
        raise MediaError(
            f"media URL scheme {parts.scheme!r} is not allowed; use http or https",
            Reason.UNSUPPORTED_SCHEME,
        )
    if "@" in parts.netloc:
        raise MediaError("media URLs must not carry credentials (user:password@)", Reason.URL_CREDENTIALS)
    return _rebuild(url, parts, _normalised_host(url, parts.hostname), port)


def _normalised_host(url: str, hostname: str | None) -> str:
    if not hostname:
        raise MediaError(f"media URL {_shown(url)} has no host", Reason.INVALID_URL)
    try:
        address = parse_host(hostname)
    except ValueError as exc:
        raise MediaError(f"media URL host is not valid: {exc}", Reason.INVALID_URL) from None
    if address is None:
        return hostname
    text = str(address).replace("%", "%25")
    return f"[{text}]" if address.version == 6 else text


def _rebuild(url: str, parts: SplitResult, host: str, port: int | None) -> httpx.URL:
    netloc = host if port is None else f"{host}:{port}"
    try:
        rebuilt = httpx.URL(urlunsplit(parts._replace(scheme=parts.scheme.lower(), netloc=netloc)))
    except httpx.InvalidURL as exc:
        raise MediaError(f"media URL {_shown(url)} is not valid: {exc}", Reason.INVALID_URL) from None
    if rebuilt.userinfo:
        raise MediaError("media URLs must not carry credentials (user:password@)", Reason.URL_CREDENTIALS)
    return rebuilt


async def vet_host(url: httpx.URL, policy: MediaPolicy, resolver: Resolver) -> IPAddress:
    """Resolve the URL's host and refuse if any address is blocked; return the one to connect to."""
    host = url.raw_host.decode("ascii")
    literal = _host_literal(url)
    addresses = [literal] if literal is not None else await _resolve(resolver, host, _port(url))
    if not policy.allow_private_urls:
        for address in addresses:
            _refuse_blocked(address, f"media URL host {host!r} resolves to {address}")
    return addresses[0]


def _host_literal(url: httpx.URL) -> IPAddress | None:
    try:
        return parse_host(url.raw_host.decode("ascii"))
    except ValueError as exc:
        raise MediaError(f"media URL host is not valid: {exc}", Reason.INVALID_URL) from None


async def _resolve(resolver: Resolver, host: str, port: int) -> list[IPAddress]:
    try:
        answers = await resolver(host, port)
        addresses = [parse_ip_literal(answer) for answer in answers]
    except (OSError, ValueError) as exc:
        raise MediaError(
            f"media URL host {host!r} could not be resolved: {exc}", Reason.UNRESOLVABLE_HOST
        ) from None
    if not addresses:
        raise MediaError(f"media URL host {host!r} resolved to no address", Reason.UNRESOLVABLE_HOST)
    return addresses


def _refuse_blocked(address: IPAddress, what: str) -> None:
    reason = is_blocked_address(address)
    if reason is not None:
        raise MediaError(
            f"{what}, which is {reason}; non-public addresses are refused", Reason.BLOCKED_ADDRESS
        )


async def _request_hop(
    client: httpx.AsyncClient,
    url: httpx.URL,
    address: IPAddress,
    policy: MediaPolicy,
    max_bytes: int,
) -> tuple[bytes, str | None]:
    """One request to the pinned address: (body, None) on success, (b"", Location) on a redirect."""
    try:
        response = await client.send(_pinned_request(client, url, address), stream=True)
        try:
            check_peer(response, policy, url)
            location = _redirect_location(response, url)
            if location is not None:
                return b"", location
            _check_status(response, url)
            return await _read_capped(response, url, max_bytes), None
        finally:
            await response.aclose()
    except httpx.TimeoutException:
        raise MediaError(f"fetching {_shown(str(url))} timed out", Reason.FETCH_TIMEOUT) from None
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        detail = str(exc) or type(exc).__name__
        raise MediaError(f"fetching {_shown(str(url))} failed: {detail}", Reason.FETCH_FAILED) from None


def _pinned_request(client: httpx.AsyncClient, url: httpx.URL, address: IPAddress) -> httpx.Request:
    # Connect to the address that was vetted, not to whatever a second lookup would return.
    host = url.raw_host.decode("ascii")
    headers = {"Host": url.netloc.decode("ascii"), "Accept-Encoding": "identity", "User-Agent": _USER_AGENT}
    extensions = {"sni_hostname": host} if url.scheme == "https" and _host_literal(url) is None else {}
    target = url.copy_with(host=str(address).replace("%", "%25"))
    return client.build_request("GET", target, headers=headers, extensions=extensions)


def check_peer(response: httpx.Response, policy: MediaPolicy, url: httpx.URL) -> None:
    """Refuse if the socket behind `response` is connected to a blocked address (DNS rebinding)."""
    if policy.allow_private_urls:
        return
    stream = response.extensions.get("network_stream")
    peer = stream.get_extra_info("server_addr") if stream is not None else None
    if not peer:
        raise MediaError(
            f"fetching {_shown(str(url))}: the connected peer address cannot be verified",
            Reason.BLOCKED_ADDRESS,
        )
    host = url.raw_host.decode("ascii")
    _refuse_blocked(parse_ip_literal(str(peer[0])), f"media URL host {host!r} connected to peer {peer[0]}")


def _redirect_location(response: httpx.Response, url: httpx.URL) -> str | None:
    if response.status_code not in _REDIRECT_STATUSES:
        return None
    location = response.headers.get("location")
    if not location:
        raise MediaError(
            f"fetching {_shown(str(url))}: redirect {response.status_code} without a Location",
            Reason.FETCH_FAILED,
        )
    return location


def _check_status(response: httpx.Response, url: httpx.URL) -> None:
    if not 200 <= response.status_code < 300:
        raise MediaError(
            f"fetching {_shown(str(url))} answered HTTP {response.status_code}", Reason.FETCH_FAILED
        )
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        # Decompressing would let a small body expand past the cap before it is counted.
        raise MediaError(
            f"fetching {_shown(str(url))}: compressed responses ({encoding}) are not accepted",
            Reason.FETCH_FAILED,
        )


async def _read_capped(response: httpx.Response, url: httpx.URL, max_bytes: int) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(url, f"declares {declared} bytes", max_bytes)
    chunks: list[bytes] = []
    total = 0
    async for chunk in response.aiter_raw():
        total += len(chunk)
        if total > max_bytes:
            raise _too_large(url, f"sent more than {max_bytes} bytes", max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(url: httpx.URL, what: str, max_bytes: int) -> MediaError:
    return MediaError(
        f"remote media {_shown(str(url))} {what}, over the {max_bytes}-byte limit", Reason.PAYLOAD_TOO_LARGE
    )


def _client(policy: MediaPolicy, transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
    # No environment proxies (the peer check must see the real server) and no connection reuse
    # across hops (each hop's pinned address and SNI get their own connection).
    if transport is None:
        transport = httpx.AsyncHTTPTransport(
            trust_env=False, retries=0, limits=httpx.Limits(max_keepalive_connections=0)
        )
    return httpx.AsyncClient(
        transport=transport, trust_env=False, follow_redirects=False, timeout=policy.fetch_timeout_s
    )


def _join(url: httpx.URL, location: str) -> str:
    try:
        return str(url.join(location))
    except httpx.InvalidURL as exc:
        raise MediaError(
            f"redirect Location {location[:200]!r} is not valid: {exc}", Reason.INVALID_URL
        ) from None


def _port(url: httpx.URL) -> int:
    return url.port or _DEFAULT_PORTS[url.scheme]


def _shown(url: str) -> str:
    return repr(url if len(url) <= 200 else url[:197] + "...")
