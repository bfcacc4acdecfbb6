"""Image validation with Pillow (spec C4): size caps from the header, before any pixel is decoded.

`Image.open` only parses the header, so width, height and pixel count are checked before
`load()` allocates the raster: a decompression bomb is refused at the cost of reading its
header. Only common raster formats are accepted, so no exotic or external decoder (EPS runs
Ghostscript) is ever reached from a request.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image

from mlxcel.media.errors import MediaError, Reason
from mlxcel.media.limits import MediaPolicy

ACCEPTED_FORMATS = ("PNG", "JPEG", "MPO", "GIF", "WEBP", "BMP", "TIFF")


@dataclass(frozen=True)
class ImageInfo:
    """A validated, decoded image: header facts plus the loaded Pillow image (first frame)."""

    width: int
    height: int
    format: str
    image: Image.Image


def validate_image(data: bytes, policy: MediaPolicy) -> ImageInfo:
    """Check `data` against the payload and decoder caps, then decode it; raises MediaError."""
    check_image_payload(len(data), policy)
    image = _open_header(data)
    try:
        check_image_dimensions(image.width, image.height, policy)
        _check_frames(image, policy)
        _decode(image)
    except BaseException:
        image.close()
        raise
    return ImageInfo(width=image.width, height=image.height, format=image.format or "", image=image)


def check_image_payload(num_bytes: int, policy: MediaPolicy) -> None:
    """Refuse an encoded image larger than `--max-image-payload-size`."""
    if num_bytes > policy.max_image_payload_bytes:
        raise MediaError(
            f"image payload is {num_bytes} bytes, over the "
            f"{policy.max_image_payload_bytes}-byte --max-image-payload-size",
            Reason.PAYLOAD_TOO_LARGE,
        )


def check_image_dimensions(width: int, height: int, policy: MediaPolicy) -> None:
    """Refuse dimensions over the decoder caps (width, height, total pixels)."""
    if width > policy.max_image_width or height > policy.max_image_height:
        raise MediaError(
            f"image is {width}x{height}, over the {policy.max_image_width}x"
            f"{policy.max_image_height} decoder limit",
            Reason.IMAGE_TOO_LARGE,
        )
    if width * height > policy.max_image_pixels:
        raise MediaError(
            f"image is {width}x{height} = {width * height} pixels, over the "
            f"{policy.max_image_pixels}-pixel decoder limit",
            Reason.IMAGE_TOO_LARGE,
        )


def _check_frames(image: Image.Image, policy: MediaPolicy) -> None:
    """Refuse an animated image (GIF, WebP, APNG) with more frames than --max-images (issue 43: frames count
    as video frames do); only the first frame is ever used. At most max_images + 1 frames are walked."""
    try:
        if not getattr(image, "is_animated", False):
            return
        image.seek(policy.max_images)  # frame index max_images exists: one too many
    except EOFError:
        image.seek(0)
        return
    except Exception as exc:  # untrusted bytes: a frame that cannot be reached is a bad image
        raise MediaError(f"image frames could not be read: {exc}", Reason.INVALID_IMAGE) from None
    raise MediaError(f"animated image has more than {policy.max_images} frames (--max-images)", Reason.IMAGE_TOO_LARGE)


def _registered_formats() -> list[str]:
    """ACCEPTED_FORMATS that this Pillow has an opener for. NOTE: Pillow 13 has no separate "MPO" opener
    (its JPEG plugin reads MPO), and naming an unknown format made every GIF, WebP, BMP and TIFF fail."""
    Image.init()
    return [name for name in ACCEPTED_FORMATS if name in Image.OPEN]


def _open_header(data: bytes) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data), formats=_registered_formats())
    except Image.DecompressionBombError as exc:
        raise MediaError(f"image refused as a decompression bomb: {exc}", Reason.IMAGE_TOO_LARGE) from None
    except Image.UnidentifiedImageError:
        raise MediaError(
            f"media is not an image in an accepted format ({', '.join(ACCEPTED_FORMATS)})",
            Reason.INVALID_IMAGE,
        ) from None
    except Exception as exc:  # untrusted bytes: any parser failure is the client's bad image
        raise MediaError(f"image header could not be read: {exc}", Reason.INVALID_IMAGE) from None


def _decode(image: Image.Image) -> None:
    try:
        image.load()
    except Image.DecompressionBombError as exc:
        raise MediaError(f"image refused as a decompression bomb: {exc}", Reason.IMAGE_TOO_LARGE) from None
    except Exception as exc:  # truncated or corrupt data surfaces as many exception types
        raise MediaError(f"image data could not be decoded: {exc}", Reason.INVALID_IMAGE) from None
