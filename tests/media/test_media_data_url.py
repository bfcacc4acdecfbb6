"""C4: data: URLs are counted against the same byte limits, checked before decoding."""

from __future__ import annotations

import base64

import pytest

from mlxcel.media.data_url import decode_data_url
from mlxcel.media.errors import MediaError, Reason


def test_c4_base64_and_percent_payloads_decode() -> None:
    data = bytes(range(256))
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    payload = decode_data_url(url, max_bytes=256)
    assert payload.data == data
    assert payload.mime_type == "image/png"
    assert decode_data_url("data:,hello%20world", max_bytes=64).data == b"hello world"
    assert decode_data_url("DATA:text/plain;charset=utf-8,a", max_bytes=1).mime_type == "text/plain"


def test_c4_whitespace_and_missing_padding_are_tolerated() -> None:
    encoded = base64.b64encode(b"abcd").decode()  # "YWJjZA=="
    assert decode_data_url(f"data:;base64,{encoded[:4]}\n{encoded[4:]}", max_bytes=4).data == b"abcd"
    assert decode_data_url("data:;base64,YWJjZA", max_bytes=4).data == b"abcd"


def test_c4_exact_limit_passes_and_one_byte_more_is_refused() -> None:
    url = "data:;base64," + base64.b64encode(b"x" * 100).decode()
    assert len(decode_data_url(url, max_bytes=100).data) == 100
    with pytest.raises(MediaError) as caught:
        decode_data_url(url, max_bytes=99)
    assert caught.value.reason_code is Reason.PAYLOAD_TOO_LARGE


def test_c4_oversized_base64_is_refused_before_decoding() -> None:
    # Not valid base64 at all: decoding it would fail with INVALID_DATA_URL, so getting
    # PAYLOAD_TOO_LARGE shows the size was judged from the length alone.
    url = "data:image/png;base64," + "!" * 4000
    with pytest.raises(MediaError) as caught:
        decode_data_url(url, max_bytes=1000)
    assert caught.value.reason_code is Reason.PAYLOAD_TOO_LARGE


def test_c4_oversized_percent_payload_is_refused() -> None:
    with pytest.raises(MediaError) as caught:
        decode_data_url("data:," + "a" * 101, max_bytes=100)
    assert caught.value.reason_code is Reason.PAYLOAD_TOO_LARGE


@pytest.mark.parametrize("url", ["data:image/png;base64", "data:;base64,ab!d", "data:;base64,a", "http://x/"])
def test_c4_malformed_data_urls(url: str) -> None:
    with pytest.raises(MediaError) as caught:
        decode_data_url(url, max_bytes=100)
    assert caught.value.reason_code is Reason.INVALID_DATA_URL
