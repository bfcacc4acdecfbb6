"""Which IP addresses remote media may come from (spec C3), and how URL hosts become addresses.

`is_blocked_address` is a pure function: it returns the reason an address is not public, or
None. Hosts are normalised the way browsers and `inet_aton` read them, so `2130706433`,
`0x7f.1` and `0177.0.0.1` are all 127.0.0.1 before anything is decided.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

IPAddress = IPv4Address | IPv6Address

# First match wins, so the broadcast /32 sits before the 240/4 it belongs to.
_IPV4_BLOCKED: tuple[tuple[IPv4Network, str], ...] = tuple(
    (IPv4Network(net), label)
    for net, label in (
        ("0.0.0.0/8", "unspecified"),
        ("10.0.0.0/8", "private"),
        ("100.64.0.0/10", "carrier-grade NAT"),
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link-local (cloud metadata)"),
        ("172.16.0.0/12", "private"),
        ("192.0.0.0/24", "IETF protocol assignments"),
        ("192.0.2.0/24", "documentation"),
        ("192.88.99.0/24", "6to4 relay anycast"),
        ("192.168.0.0/16", "private"),
        ("198.18.0.0/15", "benchmarking"),
        ("198.51.100.0/24", "documentation"),
        ("203.0.113.0/24", "documentation"),
        ("224.0.0.0/4", "multicast"),
        ("255.255.255.255/32", "broadcast"),
        ("240.0.0.0/4", "reserved"),
    )
)

_IPV6_BLOCKED: tuple[tuple[IPv6Network, str], ...] = tuple(
    (IPv6Network(net), label)
    for net, label in (
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("::/96", "IPv4-compatible (deprecated)"),
        ("::ffff:0:0:0/96", "IPv4-translated"),
        ("64:ff9b:1::/48", "local-use NAT64"),
        ("100::/64", "discard-only"),
        ("2001::/23", "IETF protocol assignments (incl. Teredo)"),
        ("2001:db8::/32", "documentation"),
        ("3fff::/20", "documentation"),
        ("fc00::/7", "unique-local"),
        ("fe80::/10", "link-local"),
        ("fec0::/10", "site-local (deprecated)"),
        ("ff00::/8", "multicast"),
    )
)

_GLOBAL_UNICAST = IPv6Network("2000::/3")
_NAT64_WELL_KNOWN = IPv6Network("64:ff9b::/96")

_NUMERIC_LABEL = re.compile(r"^(0[xX][0-9a-fA-F]*|[0-9]+)$")


def is_blocked_address(ip: str | IPAddress) -> str | None:
    """Return why `ip` is not a public address (e.g. "loopback (127.0.0.0/8)"), or None if it is.

    Accepts address objects or strings, including IPv6 zone ids and the loose IPv4 forms
    `inet_aton` accepts. Blocked IPv4 hidden inside IPv6 (mapped, compatible, translated,
    NAT64, 6to4) is blocked too. Raises ValueError for a string that is not an address.
    """
    address = ip if isinstance(ip, IPv4Address | IPv6Address) else _parse_address(ip)
    if isinstance(address, IPv4Address):
        return _ipv4_reason(address)
    return _ipv6_reason(address)


def _ipv4_reason(address: IPv4Address) -> str | None:
    for network, label in _IPV4_BLOCKED:
        if address in network:
            return f"{label} ({network})"
    return None


def _ipv6_reason(address: IPv6Address) -> str | None:
    address = IPv6Address(int(address))  # drop any zone id; the scope does not change the verdict
    embedded = _embedded_ipv4_reason(address)
    if embedded is not None:
        return embedded
    for network, label in _IPV6_BLOCKED:
        if address in network:
            return f"{label} ({network})"
    if _is_public_ipv6_space(address):
        return None
    return "reserved (outside global unicast 2000::/3)"


def _is_public_ipv6_space(address: IPv6Address) -> bool:
    # Mapped and NAT64 forms of a public IPv4 reach that public host, so they pass.
    return (
        address in _GLOBAL_UNICAST
        or address in _NAT64_WELL_KNOWN
        or address.ipv4_mapped is not None
    )


def _embedded_ipv4_reason(address: IPv6Address) -> str | None:
    for form, extract in _EMBEDDINGS:
        inner = extract(address)
        if inner is None:
            continue
        reason = _ipv4_reason(inner)
        if reason is not None:
            return f"{form} form of {inner}, which is {reason}"
    return None


def _low32_if(network: str) -> Callable[[IPv6Address], IPv4Address | None]:
    net = IPv6Network(network)

    def extract(address: IPv6Address) -> IPv4Address | None:
        return IPv4Address(int(address) & 0xFFFFFFFF) if address in net else None

    return extract


def _compatible(address: IPv6Address) -> IPv4Address | None:
    # ::/96 minus :: and ::1, which have their own names
    if int(address) >> 32 == 0 and int(address) > 1:
        return IPv4Address(int(address))
    return None


_EMBEDDINGS: tuple[tuple[str, Callable[[IPv6Address], IPv4Address | None]], ...] = (
    ("IPv4-mapped IPv6", lambda a: a.ipv4_mapped),
    ("IPv4-compatible IPv6", _compatible),
    ("IPv4-translated IPv6", _low32_if("::ffff:0:0:0/96")),
    ("NAT64 IPv6", _low32_if("64:ff9b::/96")),
    ("6to4 IPv6", lambda a: a.sixtofour),
)


def _parse_address(text: str) -> IPAddress:
    host = parse_host(text)
    if host is None:
        raise ValueError(f"{text!r} is not an IP address")
    return host


def parse_host(host: str) -> IPAddress | None:
    """Read a URL host as an IP address, or return None for a DNS name.

    Brackets and IPv6 zone ids (`%25eth0` or `%eth0`) are accepted. A host whose last label is
    numeric is IPv4 in `inet_aton` form (1-4 parts, decimal/octal/hex); if that does not parse,
    ValueError is raised rather than letting a resolver guess.
    """
    if host.startswith("[") and host.endswith("]"):
        return _parse_ipv6(host[1:-1])
    if ":" in host:
        return _parse_ipv6(host)
    return parse_ipv4_loose(host)


def _parse_ipv6(text: str) -> IPv6Address:
    try:
        return IPv6Address(text.replace("%25", "%", 1))
    except ValueError:
        raise ValueError(f"{text!r} is not a valid IPv6 address") from None


def parse_ipv4_loose(host: str) -> IPv4Address | None:
    """Parse `inet_aton`-style IPv4 (`127.1`, `0x7f.1`, `0177.0.0.1`, `2130706433`); None if not numeric."""
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if not labels or not _NUMERIC_LABEL.match(labels[-1]):
        return None
    if len(labels) > 4 or not all(_NUMERIC_LABEL.match(label) for label in labels):
        raise ValueError(f"{host!r} looks like an IPv4 address but is malformed")
    parts = [_parse_ipv4_part(label, host) for label in labels]
    return _combine_ipv4_parts(parts, host)


def _parse_ipv4_part(label: str, host: str) -> int:
    if label[:2] in ("0x", "0X"):
        return int(label[2:] or "0", 16)
    if len(label) > 1 and label.startswith("0"):
        if any(digit in "89" for digit in label):
            raise ValueError(f"{host!r} has an invalid octal part {label!r}")
        return int(label, 8)
    return int(label, 10)


def _combine_ipv4_parts(parts: list[int], host: str) -> IPv4Address:
    # The last part fills the bytes the earlier parts did not: a.b -> a.0.0.b, a -> 32 bits.
    *head, last = parts
    if any(part > 255 for part in head) or last >= 256 ** (4 - len(head)):
        raise ValueError(f"{host!r} has an IPv4 part out of range")
    value = last
    for index, part in enumerate(head):
        value |= part << (8 * (3 - index))
    return IPv4Address(value)


def parse_ip_literal(text: str) -> IPAddress:
    """Strictly parse a socket-level address string (as returned by getaddrinfo or getpeername)."""
    return ipaddress.ip_address(text.split("%", 1)[0])
