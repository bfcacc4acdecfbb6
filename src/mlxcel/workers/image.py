"""The image-generation provider (spec J): a diffusers pipeline behind a one-job-at-a-time worker.

`ImageGenerator.load` opens a diffusers checkpoint folder (`model_index.json`: Stable Diffusion,
SDXL, Flux, ... whatever `DiffusionPipeline` knows) and, where the family has one, its
image-to-image variant over the same weights (`AutoPipelineForImage2Image.from_pipe`: no second
copy). A diffusion run holds the accelerator for seconds, so the worker takes one job at a time
(batch size 1, the spec's rule); the queue bound and the deadline are `BatchWorker`'s (503, 504).

Each denoising step is logged and handed to the job's `on_step` (on the worker thread), with a
decoded preview at the steps that `partial_images` asks for; the job's abort flag is checked at
every step, so a request that timed out or lost its client stops costing compute. Images are
encoded (PNG, JPEG or WebP) on the worker thread too. A seed makes a run repeatable: the noise
comes from a CPU generator seeded with it, the same on every device.
"""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from mlxcel.loading.errors import ModelLoadError
from mlxcel.workers.base import BatchWorker, WorkerConfig, WorkerStats
from mlxcel.workers.encoder_inputs import parse_dtype

log = logging.getLogger(__name__)

OUTPUT_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


class ImageAborted(RuntimeError):
    """The job was abandoned (timeout, client gone) between two denoising steps."""


@dataclass(frozen=True, slots=True)
class ImageConfig:
    device: str = "cpu"
    dtype: str = "float32"
    worker: WorkerConfig = WorkerConfig(queue_depth=4, batch_size=1, request_timeout_s=300.0)


@dataclass(frozen=True, slots=True)
class ImageSpec:
    """One validated request: what to draw, how big, how many, from which seed."""

    prompt: str
    n: int = 1
    width: int | None = None  # None: the pipeline's default size (or the source image's, for an edit)
    height: int | None = None
    steps: int | None = None  # None: the pipeline's default
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    seed: int = 0
    output_format: str = "png"
    quality: int | None = None  # JPEG / WebP compression quality (output_compression)
    partial_images: int = 0  # previews streamed while denoising (0-3)
    source: Image.Image | None = None  # an edit's input image (image-to-image)
    strength: float = 0.8  # how far an edit moves away from its source


@dataclass(frozen=True, slots=True)
class GeneratedImage:
    data: bytes  # encoded in the job's output format
    width: int
    height: int


@dataclass(frozen=True, slots=True)
class StepProgress:
    step: int  # 1-based: step `step` of `num_steps` is done
    num_steps: int
    preview: GeneratedImage | None = None  # a partial image at this step, when one was asked for
    preview_index: int = 0


@dataclass(slots=True)
class ImageJob:
    spec: ImageSpec
    on_step: Callable[[StepProgress], None] | None = None  # called on the worker thread
    abort: threading.Event = field(default_factory=threading.Event)


def is_image_checkpoint(path: Path) -> bool:
    """A diffusers pipeline folder: `model_index.json` names its class and components."""
    return path.is_dir() and (path / "model_index.json").is_file()


def preview_steps(num_steps: int, num_previews: int) -> dict[int, int]:
    """The (1-based) steps after which a preview is decoded -> its index; spread over the run, fewer
    when the run has fewer steps than previews asked for."""
    steps = sorted({max(1, min(num_steps, round((index + 1) * num_steps / (num_previews + 1))))
                    for index in range(num_previews)})
    return {step: index for index, step in enumerate(steps)}


def encode_image(image: Image.Image, output_format: str, quality: int | None = None) -> bytes:
    """The image in its wire format; PNG is lossless and its bytes depend only on the pixels."""
    buffer = io.BytesIO()
    options: dict[str, Any] = {"quality": quality} if quality is not None and output_format != "png" else {}
    image.convert("RGB").save(buffer, OUTPUT_FORMATS[output_format], **options)
    return buffer.getvalue()


class ImageGenerator:
    """A loaded pipeline (and its image-to-image variant) and the worker thread that runs them."""

    def __init__(self, pipeline: Any, config: ImageConfig, family: str, edit_pipeline: Any | None = None) -> None:
        self.pipeline = pipeline
        self.edit_pipeline = edit_pipeline
        self.family = family  # the pipeline class, e.g. StableDiffusionPipeline
        self.config = config
        self._running: ImageJob | None = None  # the job on the worker thread, aborted by stop()
        self._worker: BatchWorker[ImageJob, list[GeneratedImage]] = BatchWorker("image", self._forward,
                                                                                config.worker)

    @classmethod
    def load(cls, folder: Path, config: ImageConfig) -> ImageGenerator:
        """Open the diffusers folder (no hub access), move it to the device and start the worker."""
        pipeline = _open_pipeline(folder, config)
        generator = cls(pipeline, config, type(pipeline).__name__, _edit_variant(pipeline))
        generator._worker.start()
        return generator

    @property
    def supports_edits(self) -> bool:
        return self.edit_pipeline is not None

    @property
    def request_timeout_s(self) -> float:
        return self.config.worker.request_timeout_s

    def default_size(self) -> tuple[int, int]:
        """(width, height) the pipeline draws when a request names no size."""
        unet = getattr(self.pipeline, "unet", None) or getattr(self.pipeline, "transformer", None)
        sample = getattr(getattr(unet, "config", None), "sample_size", None)
        factor = int(getattr(self.pipeline, "vae_scale_factor", 8))
        side = int(sample) * factor if isinstance(sample, int) else 512
        return side, side

    @property
    def size_multiple(self) -> int:
        """Width and height must be multiples of this (the VAE's downsampling, times 2 for packed latents)."""
        factor = int(getattr(self.pipeline, "vae_scale_factor", 8))
        return factor * 2 if hasattr(self.pipeline, "transformer") else factor

    def submit(self, job: ImageJob) -> Any:
        """Queue one job (WorkerBusyError when full); the future completes with [images]."""
        return self._worker.submit([job])

    def run_sync(self, job: ImageJob) -> list[GeneratedImage]:
        try:
            return self._worker.run_sync([job])[0]
        finally:
            job.abort.set()

    def stop(self, timeout: float | None = None) -> bool:
        """Refuse new jobs and end the running one at its next step (A7: shutdown does not wait out a run)."""
        running = self._running
        if running is not None:
            running.abort.set()
        return self._worker.stop(timeout)

    def stats(self) -> WorkerStats:
        return self._worker.stats()

    # --- worker thread ---

    def is_past_deadline(self) -> bool:
        """The running job is past its deadline (asked between denoising steps)."""
        return self._worker.is_past_deadline()

    def _forward(self, jobs: list[ImageJob]) -> list[list[GeneratedImage]]:
        outputs = []
        for job in jobs:
            self._running = job
            try:
                outputs.append(self._run(job))
            finally:
                self._running = None
        return outputs

    def _run(self, job: ImageJob) -> list[GeneratedImage]:
        spec = job.spec
        pipeline = self.pipeline if spec.source is None else self.edit_pipeline
        if pipeline is None:
            raise ValueError(f"the {self.family} checkpoint has no image-to-image variant, so it cannot edit images")
        arguments = self._arguments(spec, job)
        with torch.inference_mode():
            output = pipeline(**arguments)
        if job.abort.is_set():
            raise ImageAborted("image generation abandoned")
        if self.is_past_deadline():
            raise ImageAborted("image generation passed its deadline")  # the worker answers 504
        return [GeneratedImage(encode_image(image, spec.output_format, spec.quality), image.width, image.height)
                for image in output.images]

    def _arguments(self, spec: ImageSpec, job: ImageJob) -> dict[str, Any]:
        arguments: dict[str, Any] = {
            "prompt": spec.prompt, "num_images_per_prompt": spec.n, "output_type": "pil",
            "generator": torch.Generator("cpu").manual_seed(spec.seed),
            "callback_on_step_end": _StepCallback(self, job),
        }
        optional = {"num_inference_steps": spec.steps, "guidance_scale": spec.guidance_scale,
                    "negative_prompt": spec.negative_prompt}
        if spec.source is None:
            optional.update(width=spec.width, height=spec.height)
        else:  # image-to-image draws at the source's size: bring the source to the asked one
            arguments.update(image=self._sized_source(spec), strength=spec.strength)
        arguments.update({name: value for name, value in optional.items() if value is not None})
        return arguments

    def _sized_source(self, spec: ImageSpec) -> Image.Image:
        assert spec.source is not None
        multiple = self.size_multiple
        width = spec.width or max(multiple, spec.source.width // multiple * multiple)
        height = spec.height or max(multiple, spec.source.height // multiple * multiple)
        return spec.source if spec.source.size == (width, height) else spec.source.resize((width, height))

    def decode_preview(self, pipeline: Any, latents: torch.Tensor, spec: ImageSpec) -> GeneratedImage | None:
        """The first image of the batch as it stands (Stable-Diffusion-style 4-D latents only)."""
        vae = getattr(pipeline, "vae", None)
        processor = getattr(pipeline, "image_processor", None)
        if vae is None or processor is None or latents.dim() != 4:
            return None
        scaled = latents[:1] / vae.config.scaling_factor
        decoded = vae.decode(scaled.to(vae.dtype), return_dict=False)[0]
        image = processor.postprocess(decoded, output_type="pil")[0]
        return GeneratedImage(encode_image(image, spec.output_format, spec.quality), image.width, image.height)


class _StepCallback:
    """diffusers' `callback_on_step_end`: log the step, send progress and previews, honour the abort flag."""

    def __init__(self, generator: ImageGenerator, job: ImageJob) -> None:
        self._generator = generator
        self._job = job
        self._previews: dict[int, int] | None = None

    def __call__(self, pipeline: Any, index: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        num_steps = int(getattr(pipeline, "num_timesteps", 0) or 0) or index + 1
        step = index + 1
        log.info("image: step %d of %d", step, num_steps)
        if self._previews is None:
            self._previews = preview_steps(num_steps, self._job.spec.partial_images)
        # Past the deadline (issue 47) nobody can receive the image: stop as for an abort.
        if self._job.abort.is_set() or self._generator.is_past_deadline():
            pipeline._interrupt = True  # diffusers skips the remaining steps
            return tensors
        if self._job.on_step is not None:
            preview = None
            if step in self._previews and "latents" in tensors:
                preview = self._generator.decode_preview(pipeline, tensors["latents"], self._job.spec)
            self._job.on_step(StepProgress(step, num_steps, preview, self._previews.get(step, 0)))
        return tensors


def _open_pipeline(folder: Path, config: ImageConfig) -> Any:
    if not is_image_checkpoint(folder):
        raise ModelLoadError(f"--image-model {folder}: not a diffusers pipeline folder (no model_index.json)")
    try:
        from diffusers import DiffusionPipeline
    except ImportError as exc:
        raise ModelLoadError(f"--image-model needs the diffusers package (pip install 'mlxcel[image]'): "
                             f"{exc}") from None
    family = json.loads((folder / "model_index.json").read_text()).get("_class_name", "?")
    try:
        pipeline = DiffusionPipeline.from_pretrained(folder, dtype=parse_dtype(config.dtype),
                                                     local_files_only=True)
        pipeline = pipeline.to(config.device)
    except Exception as exc:  # noqa: BLE001 - any loader failure is one startup error naming the folder
        raise ModelLoadError(f"--image-model {folder}: the {family} pipeline did not load: {exc}") from None
    pipeline.set_progress_bar_config(disable=True)  # progress goes to the log, step by step
    return pipeline


def _edit_variant(pipeline: Any) -> Any | None:
    """The family's image-to-image pipeline over the same components, or None when it has none."""
    from diffusers import AutoPipelineForImage2Image

    try:
        variant = AutoPipelineForImage2Image.from_pipe(pipeline)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        log.info("image model %s has no image-to-image variant (%s): /v1/images/edits answers 400",
                 type(pipeline).__name__, exc)
        return None
    variant.set_progress_bar_config(disable=True)
    return variant
