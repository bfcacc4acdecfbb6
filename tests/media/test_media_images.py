"""C4: image caps are checked from the header, so bombs are refused before any raster is allocated."""

from __future__ import annotations

import io
import struct
import zlib

import pytest
from PIL import Image, ImageFile

from mlxcel.media.errors import MediaError, Reason
from mlxcel.media.images import validate_image
from mlxcel.media.limits import MediaPolicy


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bytes(width: int, height: int, idat: bytes = b"") -> bytes:
    """A PNG whose header claims width x height (8-bit greyscale); `idat` is the compressed data."""
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def deflate_bomb(width: int, height: int) -> bytes:
    """A real, valid PNG of zeros: a few KB that decode to width*height bytes."""
    compressor = zlib.compressobj(9)
    row = b"\x00" * (width + 1)  # filter byte + pixels
    idat = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    return png_bytes(width, height, idat)


def real_png(width: int = 4, height: int = 3) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture
def load_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Record every raster decode (ImageFile.load), with the size it would allocate."""
    calls: list[tuple[int, int]] = []
    real_load = ImageFile.ImageFile.load

    def spy(self: ImageFile.ImageFile) -> object:
        calls.append(self.size)
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", spy)
    return calls


def test_c4_a_valid_image_is_decoded(load_calls: list[tuple[int, int]]) -> None:
    info = validate_image(real_png(4, 3), MediaPolicy())
    assert (info.width, info.height, info.format) == (4, 3, "PNG")
    assert load_calls and set(load_calls) == {(4, 3)}
    assert info.image.getpixel((0, 0)) == (10, 20, 30)


def test_c4_deflate_bomb_is_refused_without_decoding(load_calls: list[tuple[int, int]]) -> None:
    bomb = deflate_bomb(4000, 4000)  # 16 MB of pixels from a few KB
    assert len(bomb) < 64 * 1024
    with pytest.raises(MediaError) as caught:
        validate_image(bomb, MediaPolicy(max_image_pixels=1_000_000))
    assert caught.value.reason_code is Reason.IMAGE_TOO_LARGE
    assert "16000000 pixels" in caught.value.message
    assert load_calls == []


@pytest.mark.parametrize(
    ("width", "height", "words"),
    [
        (8000, 8000, "pixel decoder limit"),  # 64 MP: over the default 40 MP cap, under Pillow's
        (100_000, 100_000, "decompression bomb"),  # 10 GP: Pillow's own guard fires at open
        (20_000, 10, "decoder limit"),  # too wide though tiny in pixels
    ],
)
def test_c4_header_claims_over_the_caps_are_refused(
    load_calls: list[tuple[int, int]], width: int, height: int, words: str
) -> None:
    with pytest.raises(MediaError) as caught:
        validate_image(png_bytes(width, height), MediaPolicy())
    assert caught.value.reason_code is Reason.IMAGE_TOO_LARGE
    assert words in caught.value.message
    assert load_calls == []


def test_c4_pillow_bomb_error_is_mapped(load_calls: list[tuple[int, int]]) -> None:
    # Caps raised above Pillow's own guard: Pillow refuses at open, and that is still a 400.
    policy = MediaPolicy(max_image_width=1 << 20, max_image_height=1 << 20, max_image_pixels=1 << 40)
    with pytest.raises(MediaError) as caught:
        validate_image(png_bytes(60_000, 60_000), policy)
    assert caught.value.reason_code is Reason.IMAGE_TOO_LARGE
    assert "decompression bomb" in caught.value.message
    assert load_calls == []


def test_c4_payload_cap_applies_before_parsing() -> None:
    data = real_png()
    with pytest.raises(MediaError) as caught:
        validate_image(data, MediaPolicy(max_image_payload_bytes=len(data) - 1))
    assert caught.value.reason_code is Reason.PAYLOAD_TOO_LARGE


@pytest.mark.parametrize(
    "data",
    [
        b"not an image at all",
        b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n",  # EPS would run Ghostscript
        real_png()[:40],  # truncated
        png_bytes(10, 10, b"garbage"),  # corrupt IDAT
    ],
)
def test_c4_non_images_and_corrupt_images_are_refused(data: bytes) -> None:
    with pytest.raises(MediaError) as caught:
        validate_image(data, MediaPolicy())
    assert caught.value.reason_code is Reason.INVALID_IMAGE
