"""HTTP side of the image routes (spec J): mounted only when `--image-model` loaded a pipeline.

Generations take a JSON body; edits a multipart/form-data body with one `image` file (or
`image[]`, as the openai SDK sends a list) and the same text fields. Bodies are read and checked
before the worker is asked (D1), then the run is watched for a disconnect like every route.
"""

from __future__ import annotations

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException
from starlette.requests import Request

from mlxcel.api import images
from mlxcel.api.errors import invalid_request
from mlxcel.api.replies import Reply
from mlxcel.server.body import read_json
from mlxcel.server.routes import Route, run_until_disconnect
from mlxcel.server.state import ServerState

_MAX_FIELDS = 32
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
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise invalid_request("send an image edit as multipart/form-data with an 'image' file part (Content-Type "
                              f"was {content_type or 'missing'!s})", status=415 if content_type else 400)
    try:
        form = await request.form(max_files=2, max_fields=_MAX_FIELDS)
    except MultiPartException as exc:
        raise invalid_request(f"malformed multipart body: {exc.message}") from None
    fields: dict[str, list[str]] = {}
    uploads: list[bytes] = []
    try:
        for name, value in form.multi_items():
            if not isinstance(value, UploadFile):
                fields.setdefault(name, []).append(value)
            elif name in _IMAGE_FIELDS:
                uploads.append(await value.read(max_bytes + 1))
            elif name == "mask":
                raise invalid_request("mask: masked edits (inpainting) are not available; send the image alone")
            else:
                raise invalid_request(f"unexpected file field {name!r}; upload the source image as 'image'")
    finally:
        await form.close()
    if len(uploads) != 1:
        raise invalid_request(f"image: send exactly one source image, not {len(uploads)}")
    return fields, uploads[0]


IMAGE_ROUTES: tuple[Route, ...] = (
    Route(("/v1/images/generations", "/images/generations"), ("POST",), generations),
    Route(("/v1/images/edits", "/images/edits"), ("POST",), edits),
)
