"""OpenAI's image API over the image provider (spec J): `/v1/images/generations` and `/v1/images/edits`.

A generation body is JSON, an edit body multipart/form-data (its text fields arrive as strings);
both are validated here into one `workers.image.ImageSpec`, every bad field a 400 naming it.
Images come back as `b64_json` (the only response format: the server keeps no files to link to).
`stream: true` answers OpenAI's image events: `image_generation.partial_image` previews (as many as
`partial_images` asks, 0-3), then one `image_generation.completed` per image (`image_edit.*` for
edits); mlxcel adds `image_generation.progress` events, one per denoising step (`step`,
`num_steps`), which the openai SDK passes through. Queue full is a 503, a run past
`--image-request-timeout-secs` a 504; a run whose client left is aborted at its next step.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from mlxcel.api.errors import ApiError, invalid_request, openai_error_body
from mlxcel.api.media import media_error
from mlxcel.api.providers import from_worker_error, next_from_worker
from mlxcel.api.replies import JsonReply, Reply, StreamReply
from mlxcel.api.sse import sse_frame, with_keepalive
from mlxcel.media import MediaError
from mlxcel.media.images import validate_image
from mlxcel.media.limits import MediaPolicy
from mlxcel.workers.base import WorkerError
from mlxcel.workers.image import OUTPUT_FORMATS, GeneratedImage, ImageGenerator, ImageJob, ImageSpec, StepProgress

log = logging.getLogger(__name__)

MAX_IMAGES = 10  # OpenAI's bound on n
MAX_STEPS = 500
MAX_SIDE = 4096
MAX_PARTIAL_IMAGES = 3
MAX_SEED = (1 << 63) - 1
IGNORED = ("model", "quality", "style", "moderation", "user", "safety_identifier", "input_fidelity")


@dataclass(frozen=True, slots=True)
class ImageRequest:
    spec: ImageSpec
    is_stream: bool
    is_edit: bool


# ---- validation: JSON values, or the strings of a multipart form ----

def parse_image_request(body: Mapping[str, Any], generator: ImageGenerator, *, is_form: bool = False,
                        source: Any = None) -> ImageRequest:
    """The body's fields as an ImageSpec for `generator`; a 400 naming the first bad field."""
    reader = _Fields(body, is_form)
    prompt = reader.text("prompt", required=True)
    if not prompt.strip():
        raise invalid_request("prompt: must not be empty")
    response_format = reader.text("response_format") or "b64_json"
    if response_format != "b64_json":
        raise invalid_request(f"response_format: {response_format!r} is not available; this server returns images "
                              "as 'b64_json' only (it keeps no files to link to)")
    output_format = reader.text("output_format") or "png"
    if output_format not in OUTPUT_FORMATS:
        raise invalid_request(f"output_format: one of {', '.join(OUTPUT_FORMATS)}, not {output_format!r}")
    if reader.text("background") == "transparent":
        raise invalid_request("background: 'transparent' is not available; this model draws opaque images")
    compression = reader.integer("output_compression", 0, 100)
    width, height = _size(reader.text("size"), generator.size_multiple)
    steps = reader.integer("steps", 1, MAX_STEPS)
    steps = reader.integer("num_inference_steps", 1, MAX_STEPS) if steps is None else steps
    seed = reader.integer("seed", 0, MAX_SEED)
    spec = ImageSpec(
        prompt=prompt, n=reader.integer("n", 1, MAX_IMAGES) or 1, width=width, height=height, steps=steps,
        guidance_scale=reader.number("guidance_scale", 0.0, 100.0), negative_prompt=reader.text("negative_prompt"),
        seed=secrets.randbits(32) if seed is None else seed, output_format=output_format,
        quality=compression, partial_images=reader.integer("partial_images", 0, MAX_PARTIAL_IMAGES) or 0,
        source=source, strength=_strength(reader.number("strength", 0.0, 1.0)))
    return ImageRequest(spec, reader.boolean("stream"), source is not None)


def decode_source(data: bytes, policy: MediaPolicy) -> Any:
    """An edit's input image, through the same payload and decompression-bomb checks as every image (C4)."""
    try:
        return validate_image(data, policy).image.convert("RGB")
    except MediaError as exc:
        raise media_error(exc) from None


def _strength(value: float | None) -> float:
    if value is not None and value <= 0:
        raise invalid_request("strength: must be above 0 (0 would return the source image unchanged)")
    return 0.8 if value is None else value


def _size(text: str | None, multiple: int) -> tuple[int | None, int | None]:
    if text is None or text == "auto":
        return None, None
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(part.isdigit() for part in parts):
        raise invalid_request(f"size: 'WIDTHxHEIGHT' (e.g. 512x512) or 'auto', not {text!r}")
    width, height = int(parts[0]), int(parts[1])
    for side in (width, height):
        if side < multiple or side > MAX_SIDE or side % multiple:
            raise invalid_request(f"size: {text!r}: each side must be a multiple of {multiple} from {multiple} to "
                                  f"{MAX_SIDE} for this model")
    return width, height


class _Fields:
    """Typed reads of a body's fields; a form's values are strings, a JSON body's are typed."""

    def __init__(self, body: Mapping[str, Any], is_form: bool) -> None:
        self._body = body
        self._is_form = is_form

    def _raw(self, name: str) -> Any:
        value = self._body.get(name)
        if self._is_form and isinstance(value, list):
            if len(value) > 1:
                raise invalid_request(f"{name}: give it once, not {len(value)} times")
            value = value[0] if value else None
        return value

    def text(self, name: str, *, required: bool = False) -> str | None:
        value = self._raw(name)
        if value is None:
            if required:
                raise invalid_request(f"{name}: required")
            return None
        if not isinstance(value, str):
            raise invalid_request(f"{name}: must be a string, not {type(value).__name__}")
        return value

    def integer(self, name: str, minimum: int, maximum: int) -> int | None:
        value = self._raw(name)
        if value is None:
            return None
        if self._is_form and isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
            raise invalid_request(f"{name}: a whole number from {minimum} to {maximum}, not {value!r}")
        return value

    def number(self, name: str, minimum: float, maximum: float) -> float | None:
        value = self._raw(name)
        if value is None:
            return None
        if self._is_form and isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not is_number or not math.isfinite(value) or not minimum <= value <= maximum:
            raise invalid_request(f"{name}: a number from {minimum:g} to {maximum:g}, not {value!r}")
        return float(value)

    def boolean(self, name: str) -> bool:
        value = self._raw(name)
        if self._is_form and isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            value = value.lower() in ("true", "1")
        if value is None:
            return False
        if not isinstance(value, bool):
            raise invalid_request(f"{name}: must be true or false, not {value!r}")
        return value


# ---- running a request ----

class _Events:
    """Progress and the outcome, from the worker thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[StepProgress | list[GeneratedImage] | BaseException] = asyncio.Queue()

    def put_threadsafe(self, item: StepProgress | list[GeneratedImage] | BaseException) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def get(self) -> StepProgress | list[GeneratedImage] | BaseException:
        return await self._queue.get()


@dataclass(slots=True)
class _Run:
    job: ImageJob
    events: _Events
    deadline: float
    timeout_s: float

    async def next(self) -> StepProgress | list[GeneratedImage]:
        """The next progress report or the images; 504 past the deadline, the worker's errors mapped."""
        return await next_from_worker(self.events.get, self.deadline, self.job.abort,
                                      f"the image request took longer than {self.timeout_s:g} s "
                                      "(--image-request-timeout-secs)")


def _start(generator: ImageGenerator, spec: ImageSpec) -> _Run:
    loop = asyncio.get_running_loop()
    events = _Events(loop)
    job = ImageJob(spec, on_step=events.put_threadsafe)
    try:
        future = generator.submit(job)  # 503 before any byte when the queue is full
    except WorkerError as exc:
        raise from_worker_error(exc) from None
    future.add_done_callback(lambda done: events.put_threadsafe(_outcome(done)))
    return _Run(job, events, loop.time() + generator.request_timeout_s, generator.request_timeout_s)


def _outcome(future: Any) -> list[GeneratedImage] | BaseException:
    if future.cancelled():
        return RuntimeError("the image job was cancelled")
    error = future.exception()
    return error if error is not None else future.result()[0]


async def create_images(generator: ImageGenerator, request: ImageRequest, keepalive_s: float) -> Reply:
    """POST /v1/images/generations and /v1/images/edits: the images, whole or as events."""
    run = _start(generator, request.spec)
    if request.is_stream:
        async def on_close() -> None:
            run.job.abort.set()

        frames = _stream_events(run, request)
        return StreamReply(with_keepalive(frames, keepalive_s), on_close)
    try:
        while not isinstance(item := await run.next(), list):
            pass
    finally:
        run.job.abort.set()  # a client that left (cancelled) stops the run at its next step
    return JsonReply(_images_body(item, request.spec))


def _images_body(images: list[GeneratedImage], spec: ImageSpec) -> dict[str, Any]:
    first = images[0]
    return {"created": int(time.time()), "background": "opaque", "output_format": spec.output_format,
            "size": f"{first.width}x{first.height}",
            "data": [{"b64_json": base64.b64encode(image.data).decode("ascii")} for image in images],
            "usage": _usage()}


def _usage() -> dict[str, Any]:
    # OpenAI counts image tokens for its own models; a diffusion pipeline has none to report.
    return {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
            "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}}


async def _stream_events(run: _Run, request: ImageRequest) -> AsyncIterator[str]:
    prefix = "image_edit" if request.is_edit else "image_generation"
    spec = request.spec
    common = {"background": "opaque", "output_format": spec.output_format, "quality": "auto"}
    try:
        while True:
            try:
                item = await run.next()
            except ApiError as exc:  # headers are gone: the error goes out as the stream's last event
                yield sse_frame({"type": "error", **openai_error_body(exc)}, "error")
                return
            if isinstance(item, list):
                for image in item:
                    event = {"type": f"{prefix}.completed", "b64_json": base64.b64encode(image.data).decode("ascii"),
                             "created_at": int(time.time()), "size": f"{image.width}x{image.height}",
                             **common, "usage": _usage()}
                    yield sse_frame(event, event["type"])
                return
            yield sse_frame(_progress_event(prefix, item), f"{prefix}.progress")
            if item.preview is not None:
                preview = item.preview
                event = {"type": f"{prefix}.partial_image", "b64_json": base64.b64encode(preview.data).decode("ascii"),
                         "created_at": int(time.time()), "partial_image_index": item.preview_index,
                         "size": f"{preview.width}x{preview.height}", **common}
                yield sse_frame(event, event["type"])
    finally:
        run.job.abort.set()


def _progress_event(prefix: str, progress: StepProgress) -> dict[str, Any]:
    return {"type": f"{prefix}.progress", "step": progress.step, "num_steps": progress.num_steps,
            "created_at": int(time.time())}
