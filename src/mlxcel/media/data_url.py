"""`data:` URLs (RFC 2397) decoded under a byte cap that is checked before decoding (spec C4)."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

from mlxcel.media.errors import MediaError, Reason

_WHITESPACE = " \t\r\n\f\v"


@dataclass(frozen=True)
class DataPayload:
    """The bytes of a data: URL and its declared media type (empty if none was given)."""

    mime_type: str
    data: bytes


def decode_data_url(url: str, max_bytes: int) -> DataPayload:
    """Decode `data:[<type>][;base64],<payload>`, refusing before decoding if it would exceed `max_bytes`."""
    if url[:5].lower() != "data:":
        raise MediaError("not a data: URL", Reason.INVALID_DATA_URL)
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise MediaError("data: URL has no ',' before its payload", Reason.INVALID_DATA_URL)
    params = [p.strip() for p in header.split(";")]
    is_base64 = params[-1].lower() == "base64"
    mime_type = params[0].lower() if params[0] and "=" not in params[0] else ""
    data = _decode_base64(payload, max_bytes) if is_base64 else _decode_percent(payload, max_bytes)
    return DataPayload(mime_type=mime_type, data=data)


def _decode_base64(payload: str, max_bytes: int) -> bytes:
    # Bound the size from the text length before copying or decoding anything:
    # 4 base64 characters carry 3 bytes, and at most 2 of them are padding.
    num_chars = len(payload) - sum(payload.count(c) for c in _WHITESPACE)
    if num_chars * 3 // 4 - 2 > max_bytes:
        raise _too_large(num_chars * 3 // 4, max_bytes)
    compact = "".join(payload.split()) if num_chars != len(payload) else payload
    compact += "=" * (-len(compact) % 4)  # some encoders drop the padding
    decoded_len = len(compact) // 4 * 3 - compact[-2:].count("=")
    if decoded_len > max_bytes:
        raise _too_large(decoded_len, max_bytes)
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"data: URL payload is not valid base64: {exc}", Reason.INVALID_DATA_URL) from None


def _decode_percent(payload: str, max_bytes: int) -> bytes:
    # Percent-decoding never grows the text, but one character may be several UTF-8 bytes.
    if len(payload) > 3 * max_bytes:
        raise _too_large(len(payload) // 3, max_bytes)
    data = unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise _too_large(len(data), max_bytes)
    return data


def _too_large(size: int, max_bytes: int) -> MediaError:
    return MediaError(
        f"data: URL payload is about {size} bytes, over the {max_bytes}-byte limit",
        Reason.PAYLOAD_TOO_LARGE,
    )
