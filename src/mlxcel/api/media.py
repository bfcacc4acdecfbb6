"""Media parts of a request, for every protocol (spec C2-C5).

Each adapter turns its own media blocks into `MediaRef`s (OpenAI `image_url` /
`input_audio` / `video_url` parts, Anthropic image blocks, Responses `input_image`) and
awaits `validate_media(ctx, refs)`. Every reference is resolved and checked first (sandboxed
files, SSRF-safe fetch, payload and pixel limits), so the security layer always runs; a
refusal is a 400 whose `code` is the media layer's reason. Then, unless the served model takes
images (a block-diffusion model with a vision tower, U), the request is a 400 naming the kinds
it carried.
"""

from __future__ import annotations

import asyncio
import io
import re
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

from mlxcel.api.context import ApiContext
from mlxcel.api.errors import INVALID_REQUEST, ApiError, truncate_message
from mlxcel.api.generation import Prompt
from mlxcel.media import MediaError, MediaKind, MediaRef, Reason, resolve_media_parts
from mlxcel.media.resolve import ResolvedMedia

MEDIA_NOT_ACCEPTED = "media_not_accepted"  # the `code` of the model-is-text-only 400
_AUDIO_TYPES = {"mp3": "audio/mpeg", "wav": "audio/wav", "m4a": "audio/mp4", "aac": "audio/aac"}
_FORMAT = re.compile(r"^[a-z0-9][a-z0-9.+-]{0,31}$")


async def validate_media(ctx: ApiContext, refs: Sequence[MediaRef], *,
                         takes_images: bool = False) -> list[ResolvedMedia]:
    """Resolve and validate every reference under `ctx.media_policy`; raises ApiError(400).

    A route that passes images on (`takes_images`: OpenAI chat) to a model that takes them
    (`ctx.image_marker`, a block-diffusion model's vision tower, U) gets its image parts back,
    checked; any other media part, once it passed every check, is refused
    naming its kind.
    """
    if not refs:
        return []
    try:
        resolved = await resolve_media_parts(refs, ctx.media_policy)
    except MediaError as exc:
        raise media_error(exc) from None
    # a vision-language model (issue 43) takes a video as its sampled frames
    kinds = (MediaKind.IMAGE, MediaKind.VIDEO) if ctx.image_prompter is not None else (MediaKind.IMAGE,)
    if takes_images and ctx.image_marker is not None and all(ref.kind in kinds for ref in refs):
        return resolved
    raise media_not_accepted(refs)


def video_marker(ctx: ApiContext) -> str | None:
    """The text a video part renders as, for a model that takes videos as such (Qwen2.5-VL's temporal
    patches, issue 43: its prompter's `video_marker` and `prepare_media`); None: a video is its frames."""
    return getattr(ctx.image_prompter, "video_marker", None)


async def with_images(ctx: ApiContext, prompt: Prompt, media: Sequence[ResolvedMedia]) -> Prompt:
    """`prompt` with its checked images (issue 43): for a vision-language model, each marker expanded into
    the image's placeholder tokens and the images processed (off the event loop: decoding and resizing
    pixels); a video part gives its frames, each an image. A marker count that differs from the image
    count is a 400. Before the engine sees the prompt, so the length check and `usage` count image tokens."""
    if not media:
        return prompt
    images = tuple(data for item in media for data in _image_bytes(item))
    if ctx.image_prompter is None:  # a block-diffusion model's own worker (U) takes the encoded images
        return replace(prompt, images=images)
    prepare = partial(ctx.image_prompter.prepare, list(prompt.token_ids), images)
    if video_marker(ctx) is not None and any(item.kind is MediaKind.VIDEO for item in media):
        stills = tuple(item.data for item in media if item.kind is not MediaKind.VIDEO)
        videos = tuple((_image_bytes(item), item.video.fps if item.video else 1.0) for item in media
                       if item.kind is MediaKind.VIDEO)
        prepare = partial(ctx.image_prompter.prepare_media, list(prompt.token_ids), stills, videos)
    try:
        token_ids, inputs = await asyncio.to_thread(prepare)
    except ValueError as exc:
        raise ApiError(400, truncate_message(str(exc)), INVALID_REQUEST, code="invalid_image_prompt") from None
    return replace(prompt, token_ids=tuple(token_ids), image_inputs=inputs)


def _image_bytes(item: ResolvedMedia) -> list[bytes]:
    """An image part's bytes; a video's sampled frames, each as PNG bytes."""
    if item.kind is not MediaKind.VIDEO:
        return [item.data]
    frames = []
    for frame in item.frames:
        buffer = io.BytesIO()
        frame.save(buffer, format="PNG")
        frames.append(buffer.getvalue())
    return frames


def media_error(exc: MediaError) -> ApiError:
    """A refused reference: 400 invalid_request_error, `code` = the reason (e.g. blocked_address)."""
    return ApiError(400, truncate_message(exc.message), INVALID_REQUEST, code=exc.reason_code.value)


def media_not_accepted(refs: Sequence[MediaRef]) -> ApiError:
    """400 "the served model does not accept image input" (audio and video named likewise)."""
    kinds = [kind.value for kind in MediaKind if any(ref.kind is kind for ref in refs)]
    return ApiError(400, f"the served model does not accept {' or '.join(kinds)} input", INVALID_REQUEST,
                    code=MEDIA_NOT_ACCEPTED)


def base64_data_url(mime_type: str, data: str) -> str:
    """A data: URL for base64 `data` (Anthropic image sources, OpenAI input_audio)."""
    return f"data:{mime_type};base64,{data}"


def audio_data_url(data: str, audio_format: str) -> str:
    """OpenAI `input_audio` {data, format} as a data: URL the media layer reads like any other."""
    name = audio_format.strip().lower()
    if not _FORMAT.match(name):
        raise media_error(MediaError(f"input_audio format {audio_format!r} is not an audio format name",
                                     Reason.INVALID_MEDIA_PART))
    return base64_data_url(_AUDIO_TYPES.get(name, f"audio/{name}"), data)
