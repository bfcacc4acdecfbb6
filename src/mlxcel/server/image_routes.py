"""HTTP side of the image routes (spec J): mounted only when `--image-model` loaded a pipeline.

Generations take a JSON body; edits a multipart/form-data body with one `image` file (or
`image[]`, as the openai SDK sends a list) and the same text fields. Bodies are read and checked
before the worker is asked (D1), then the run is watched for a disconnect like every route.
"""

from __future__ import annotations

from starlette.datastructures import UploadFile
from starlette.requests import Request

from mlxcel.api import images
from mlxcel.api.errors import invalid_request
from mlxcel.api.replies import Reply
from mlxcel.server.body import read_json, read_multipart
from mlxcel.server.routes import Route, run_until_disconnect
from mlxcel.server.state import ServerState

_IMAGE_FIELDS = ("image", "image[]")


async def generations(request: Request, state: ServerState) -> Reply:
    body = await read_json(request)  # D1: body errors before anything else
    generator, _ = state.require_image()
    parsed = images.parse_image_request(body, generator)
    return await run_until_disconnect(request, images.create_images(generator, parsed, state.config.sse_keepalive_s))


async def edits(request: Request, state: ServerState) -> Reply:
    fields, data = await _read_edit_form(request, state.media.max_image_payload_bytes)
    generator, _ = state.require_image()
    source = images.decode_source(data, state.media)
    parsed = images.parse_image_request(fields, generator, is_form=True, source=source)
    if not generator.supports_edits:
        raise invalid_request(f"image: the {generator.family} model has no image-to-image variant, so it cannot "
                              "edit images; use /v1/images/generations")
    return await run_until_disconnect(request, images.create_images(generator, parsed, state.config.sse_keepalive_s))


async def _read_edit_form(request: Request, max_bytes: int) -> tuple[dict[str, list[str]], bytes]:
    """The text fields and the one source image of a multipart/form-data body; 400 otherwise."""
    async def read_image(name: str, value: UploadFile) -> bytes:
        if name in _IMAGE_FIELDS:
            return await value.read(max_bytes + 1)
        if name == "mask":
            raise invalid_request("mask: masked edits (inpainting) are not available; send the image alone")
        raise invalid_request(f"unexpected file field {name!r}; upload the source image as 'image'")

    fields, uploads = await read_multipart(
        request, expected="an image edit as multipart/form-data with an 'image' file part", max_files=2,
        read_file=read_image)
    if len(uploads) != 1:
        raise invalid_request(f"image: send exactly one source image, not {len(uploads)}")
    return fields, uploads[0]


IMAGE_ROUTES: tuple[Route, ...] = (
    Route(("/v1/images/generations", "/images/generations"), ("POST",), generations),
    Route(("/v1/images/edits", "/images/edits"), ("POST",), edits),
)
