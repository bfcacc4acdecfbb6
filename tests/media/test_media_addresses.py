"""C3: the address classifier as a pure function, over every blocked family and host notation."""

from __future__ import annotations

import pytest

from mlxcel.media.addresses import is_blocked_address, parse_host

BLOCKED = [
    # (address, a word the reason must contain)
    ("127.0.0.1", "loopback"),
    ("127.255.255.254", "loopback"),
    ("0.0.0.0", "unspecified"),
    ("0.1.2.3", "unspecified"),
    ("10.0.0.1", "private"),
    ("172.16.0.1", "private"),
    ("172.31.255.255", "private"),
    ("192.168.1.1", "private"),
    ("169.254.169.254", "link-local"),
    ("169.254.0.1", "link-local"),
    ("100.64.0.1", "carrier-grade NAT"),
    ("100.127.255.255", "carrier-grade NAT"),
    ("192.0.0.8", "protocol assignments"),
    ("192.0.2.10", "documentation"),
    ("198.51.100.7", "documentation"),
    ("203.0.113.9", "documentation"),
    ("198.18.0.1", "benchmarking"),
    ("198.19.255.255", "benchmarking"),
    ("224.0.0.1", "multicast"),
    ("239.255.255.250", "multicast"),
    ("255.255.255.255", "broadcast"),
    ("240.0.0.1", "reserved"),
    ("250.1.2.3", "reserved"),
    ("::", "unspecified"),
    ("::1", "loopback"),
    ("fc00::1", "unique-local"),
    ("fd12:3456::1", "unique-local"),
    ("fe80::1", "link-local"),
    ("fe80::1%eth0", "link-local"),
    ("febf::1", "link-local"),
    ("fec0::1", "site-local"),
    ("ff02::1", "multicast"),
    ("ff0e::1", "multicast"),
    ("2001:db8::1", "documentation"),
    ("3fff::1", "documentation"),
    ("100::1", "discard-only"),
    ("2001::1", "Teredo"),
    ("64:ff9b:1::1", "local-use NAT64"),
    ("5f00::1", "outside global unicast"),
    # blocked IPv4 written inside IPv6
    ("::ffff:127.0.0.1", "IPv4-mapped IPv6 form of 127.0.0.1"),
    ("::ffff:7f00:1", "IPv4-mapped IPv6 form of 127.0.0.1"),
    ("::ffff:169.254.169.254", "IPv4-mapped IPv6 form of 169.254.169.254"),
    ("::ffff:10.0.0.1", "private"),
    ("::ffff:100.64.0.1", "carrier-grade NAT"),
    ("::ffff:0.0.0.0", "unspecified"),
    ("::127.0.0.1", "IPv4-compatible IPv6 form of 127.0.0.1"),
    ("::a9fe:a9fe", "IPv4-compatible IPv6 form of 169.254.169.254"),
    ("::192.168.0.1", "private"),
    ("::8.8.8.8", "IPv4-compatible (deprecated)"),
    ("::ffff:0:7f00:1", "IPv4-translated IPv6 form of 127.0.0.1"),
    ("64:ff9b::7f00:1", "NAT64 IPv6 form of 127.0.0.1"),
    ("64:ff9b::a9fe:a9fe", "NAT64 IPv6 form of 169.254.169.254"),
    ("2002:7f00:1::", "6to4 IPv6 form of 127.0.0.1"),
    ("2002:c0a8:101::1", "6to4 IPv6 form of 192.168.1.1"),
    # odd IPv4 notations, all 127.0.0.1 or 169.254.169.254
    ("2130706433", "loopback"),
    ("0x7f000001", "loopback"),
    ("0x7f.1", "loopback"),
    ("0177.0.0.1", "loopback"),
    ("017700000001", "loopback"),
    ("127.1", "loopback"),
    ("127.0.1", "loopback"),
    ("0x7F.0.0.1", "loopback"),
    ("127.0.0.1.", "loopback"),
    ("2852039166", "link-local"),
    ("0xa9.0xfe.0xa9.0xfe", "link-local"),
    ("0251.0376.0251.0376", "link-local"),
    ("0", "unspecified"),
    ("0x", "unspecified"),
]

PUBLIC = [
    "8.8.8.8",
    "1.1.1.1",
    "93.184.216.34",
    "100.63.255.255",  # just below CGNAT
    "100.128.0.0",  # just above CGNAT
    "172.15.255.255",
    "172.32.0.0",
    "198.17.255.255",
    "198.20.0.0",
    "223.255.255.255",
    "2606:4700::1111",
    "2001:4860:4860::8888",
    "2a00:1450:4001::1",
    "::ffff:8.8.8.8",
    "64:ff9b::808:808",
    "2002:808:808::1",
    "134744072",  # 8.8.8.8 as one decimal number
]


@pytest.mark.parametrize(("address", "reason_word"), BLOCKED)
def test_c3_blocked_families_are_refused_with_a_reason(address: str, reason_word: str) -> None:
    reason = is_blocked_address(address)
    assert reason is not None, f"{address} should be blocked"
    assert reason_word in reason


@pytest.mark.parametrize("address", PUBLIC)
def test_c3_public_addresses_pass(address: str) -> None:
    assert is_blocked_address(address) is None


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("2130706433", "127.0.0.1"),
        ("0x7f.1", "127.0.0.1"),
        ("0177.0.0.1", "127.0.0.1"),
        ("127.1", "127.0.0.1"),
        ("10.1", "10.0.0.1"),
        ("192.168.257", "192.168.1.1"),
        ("[::1]", "::1"),
        ("[fe80::1%25eth0]", "fe80::1%eth0"),
        ("::ffff:127.0.0.1", "::ffff:7f00:1"),
    ],
)
def test_c3_host_forms_normalise_to_one_address(host: str, expected: str) -> None:
    assert str(parse_host(host)) == expected


@pytest.mark.parametrize("host", ["example.com", "media.example", "1e100.net", "127.0.0.1.nip.io", "a.0x1g"])
def test_c3_dns_names_are_not_addresses(host: str) -> None:
    assert parse_host(host) is None


@pytest.mark.parametrize(
    "host", ["1.2.3.4.5", "08.0.0.1", "256.0.0.1", "1.2.3.256", "1.2.65536", "4294967296", "1..1", "[::g]"]
)
def test_c3_malformed_numeric_hosts_are_errors_not_names(host: str) -> None:
    with pytest.raises(ValueError):
        parse_host(host)


def test_c3_classifier_rejects_non_addresses() -> None:
    with pytest.raises(ValueError):
        is_blocked_address("example.com")
