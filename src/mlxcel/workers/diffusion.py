"""Block-diffusion text models (spec U): a DiffusionGemma checkpoint served by one serial worker.

A block-diffusion model does not decode token by token: it denoises a whole block (the
checkpoint's `canvas_length`) over several steps, commits it, and starts the next. So it gets
no place in the batch scheduler; `BlockDiffusionWorker` runs transformers' own
`DiffusionGemmaForBlockDiffusion.generate` for one request at a time, in arrival order, on its
own thread, and hands each committed block to the request's sink as one `TokenEvent`. It offers
the few calls `engine.client.EngineClient` makes of an engine core (submit, abort, stats, stop,
config), so every chat-shaped route, its chat features (reasoning split, stop strings) and the
ops routes serve it unchanged. The queue is bounded by `--max-queue-depth` (503 when full) and
each request has a deadline from admission (504 past it, while queued or running).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from mlxcel.config import EngineConfig
from mlxcel.types import (
    ContextOverflowError, DiffusionStats, EngineShutdownError, EngineStats, FinishReason, PrefixCacheReset, PrefixCacheStats,
    QueueFullError, Request,
    SlotStats, TokenEvent,
)

log = logging.getLogger(__name__)

MODEL_TYPE = "diffusion_gemma"
SAMPLERS = ("entropy-bound", "confidence")  # --diffusion-sampler
Sink = Callable[[TokenEvent], None]
GATEWAY_TIMEOUT = 504


def is_block_diffusion_checkpoint(path: Path) -> bool:
    """A Hugging Face folder whose config.json names the DiffusionGemma architecture."""
    config_file = path / "config.json"
    if not path.is_dir() or not config_file.is_file():
        return False
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") == MODEL_TYPE


@dataclass(frozen=True, slots=True)
class DiffusionOptions:
    """--diffusion-sampler, --diffusion-threshold, --max-denoising-steps and the request deadline.

    None / 0 keep the checkpoint's generation_config.json values (transformers' defaults where it
    has none)."""

    sampler: str = "entropy-bound"
    threshold: float | None = None  # the entropy bound, or the confidence a token needs to be accepted
    max_denoising_steps: int = 0  # per block; 0 = the checkpoint's
    request_timeout_s: float = 300.0  # from admission to the last block (504 past it)

    def __post_init__(self) -> None:
        if self.sampler not in SAMPLERS:
            raise ValueError(f"--diffusion-sampler must be one of {', '.join(SAMPLERS)}; not {self.sampler!r}")
        if self.threshold is not None and self.sampler == "confidence" and not 0 < self.threshold <= 1:
            raise ValueError(f"--diffusion-threshold {self.threshold:g}: the confidence sampler takes a "
                             "probability in (0, 1]")
        if self.threshold is not None and self.threshold <= 0:
            raise ValueError(f"--diffusion-threshold must be positive, not {self.threshold:g}")
        if self.max_denoising_steps < 0:
            raise ValueError(f"--max-denoising-steps must be 0 (the checkpoint's) or more, not "
                             f"{self.max_denoising_steps}")
        if self.request_timeout_s <= 0:
            raise ValueError("--diffusion-request-timeout must be positive")


def load_block_diffusion(path: Path, options: DiffusionOptions, *, device: str, dtype: torch.dtype) -> Any:
    """transformers' DiffusionGemmaForBlockDiffusion with the sampler the options name."""
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        EntropyBoundSampler, EntropyBoundSamplerConfig,
    )

    class ConfidenceSampler(EntropyBoundSampler):
        """Accepts the positions whose most likely token has at least `threshold` probability, and
        always the most confident one, so every step makes progress (Fast-dLLM's rule)."""

        def accept_canvas(self, current_canvas: torch.Tensor, denoiser_canvas: torch.Tensor, logits: torch.Tensor,
                          cur_step: int) -> torch.Tensor:
            confidence = torch.softmax(logits.float(), dim=-1).amax(dim=-1)
            best = confidence == confidence.amax(dim=-1, keepdim=True)
            self.accepted_token_mask = (confidence >= self.entropy_bound) | best
            return torch.where(self.accepted_token_mask, logits.argmax(dim=-1), current_canvas)

    class ServedDiffusionGemma(DiffusionGemmaForBlockDiffusion):  # type: ignore[misc,valid-type]
        def _prepare_sampler(self, generation_config: Any) -> EntropyBoundSampler:
            bound = options.threshold if options.threshold is not None else \
                generation_config.sampler_config.entropy_bound
            if options.sampler == "confidence":
                bound = options.threshold if options.threshold is not None else 0.9
            sampler_class = ConfidenceSampler if options.sampler == "confidence" else EntropyBoundSampler
            return sampler_class(EntropyBoundSamplerConfig(entropy_bound=float(bound)), self.config.canvas_length,
                                 self.config.text_config.vocab_size, generation_config.max_denoising_steps)

    model = ServedDiffusionGemma.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


class VisionInputs:
    """A checkpoint's vision tower as prompts see it: each image marker token becomes begin-of-image,
    the image's soft tokens and end-of-image, and the image its pixel patches (Gemma 4's processor)."""

    def __init__(self, path: Path, config: Any) -> None:
        from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

        vision = config.vision_config
        if (path / "preprocessor_config.json").is_file():  # the checkpoint's own resize and patch budget
            self.processor = Gemma4ImageProcessorPil.from_pretrained(path)
        else:
            self.processor = Gemma4ImageProcessorPil(patch_size=vision.patch_size,
                                                     pooling_kernel_size=vision.pooling_kernel_size)
        self.image_token_id = int(config.image_token_id)
        self.boi_token_id = int(config.boi_token_id)
        self.eoi_token_id = int(config.eoi_token_id)

    def count_markers(self, token_ids: list[int]) -> int:
        return sum(token == self.image_token_id for token in token_ids)

    def prepare(self, token_ids: list[int], images: tuple[bytes, ...]) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The prompt with each marker expanded, and generate's vision kwargs."""
        import io

        from PIL import Image

        decoded = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
        features = self.processor(images=decoded, return_tensors="pt")
        counts = iter(int(n) for n in features["num_soft_tokens_per_image"])
        expanded: list[int] = []
        for token in token_ids:
            if token == self.image_token_id:
                expanded += [self.boi_token_id, *[self.image_token_id] * next(counts), self.eoi_token_id]
            else:
                expanded.append(token)
        ids = torch.tensor([expanded])
        return expanded, {"pixel_values": features["pixel_values"], "image_position_ids": features["image_position_ids"],
                          "mm_token_type_ids": (ids == self.image_token_id).long()}


def vision_inputs(path: Path, model: Any) -> VisionInputs | None:
    """The vision side when the checkpoint has a vision tower with its weights; None for text only."""
    tower = getattr(getattr(model.model, "encoder", None), "vision_tower", None)
    if tower is None or getattr(model.config, "vision_config", None) is None or model.config.image_token_id is None:
        return None
    return VisionInputs(path, model.config)


class _Stop(Exception):
    """Raised from the streamer to end transformers' generate early (abort, deadline, EOS, length)."""


@dataclass(slots=True)
class _Job:
    request: Request
    sink: Sink
    deadline: float  # time.monotonic()
    num_prompt_tokens: int
    num_sent: int = 0
    is_aborted: bool = False
    is_done: bool = False
    started_at: float = 0.0


@dataclass(slots=True)
class _Counts:
    started: int = 0
    completed: int = 0
    aborted: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    steps: int = 0  # denoising forward passes
    blocks: int = 0
    timed_out: int = 0
    max_len: int = 0


class _BlockStreamer:
    """transformers' streamer protocol: the prompt first, then each committed block, and each
    denoising step's draft (`put_draft`), where the worker checks for an abort or the deadline."""

    def __init__(self, worker: BlockDiffusionWorker, job: _Job) -> None:
        self._worker = worker
        self._job = job
        self._saw_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._saw_prompt:
            self._saw_prompt = True
            return
        self._worker.commit_block(self._job, [int(t) for t in value[0].tolist()])

    def put_draft(self, value: torch.Tensor) -> None:
        self._worker.count_step(self._job)

    def end(self) -> None:
        return None


class BlockDiffusionWorker:
    """One DiffusionGemma model, one thread, requests in arrival order, a block per event."""

    def __init__(self, model: Any, config: EngineConfig, options: DiffusionOptions, *, context_length: int,
                 eos_token_ids: frozenset[int], device: str = "cpu", vision: VisionInputs | None = None) -> None:
        self.model = model
        self.vision = vision
        self.config = config  # EngineClient reads decode_timeout_s and max_queue_depth (F9 may replace it)
        self.options = options
        self.slot_context = config.slot_context(context_length)
        self.canvas_length = int(model.config.canvas_length)
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.failure: BaseException | None = None
        self._queue: collections.deque[_Job] = collections.deque()
        self._jobs: dict[str, _Job] = {}
        self._current: _Job | None = None
        self._lock = threading.Condition()
        self._is_stopping = False
        self._counts = _Counts()
        self._thread = threading.Thread(target=self._run, name="mlxcel-diffusion", daemon=True)

    # --- the EngineCore calls EngineClient makes ----------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        """False once the thread died unasked (/health 503, exit 1); a stopped worker is not a failure."""
        return self.failure is None and (self._is_stopping or self._thread.is_alive())

    def submit(self, request: Request, sink: Sink) -> None:
        """Queue a request; QueueFullError when --max-queue-depth requests wait already."""
        num_prompt = len(request.prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("the prompt has no tokens")
        self._check_images(request)
        if num_prompt + self.canvas_length > self.slot_context:
            raise ContextOverflowError(num_prompt, self.slot_context)
        job = _Job(request, sink, time.monotonic() + self.options.request_timeout_s, num_prompt)
        with self._lock:
            if self._is_stopping or not self._thread.is_alive():
                raise EngineShutdownError("the block-diffusion worker is not running")
            if len(self._queue) >= self.config.max_queue_depth:
                raise QueueFullError(f"the block-diffusion queue is full ({len(self._queue)} requests waiting)")
            self._queue.append(job)
            self._jobs[request.request_id] = job
            self._lock.notify()

    def _check_images(self, request: Request) -> None:
        """Every image has its marker in the prompt, and only a model with a vision tower gets one (400)."""
        if self.vision is None:
            if request.images:
                raise ValueError("the served model has no vision tower: image input is not accepted")
            return
        markers = self.vision.count_markers(request.prompt_token_ids)
        if markers != len(request.images):
            raise ValueError(f"the prompt holds {markers} image markers for {len(request.images)} images")

    def abort(self, request_id: str) -> None:
        with self._lock:
            job = self._jobs.get(request_id)
            if job is None:
                return
            job.is_aborted = True
            if job in self._queue:
                self._queue.remove(job)
                self._finish(job, FinishReason.ABORT)

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn` now: the worker holds no state a call could race with but the model itself."""
        future: Future[Any] = Future()
        try:
            future.set_result(fn())
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            future.set_exception(exc)
        return future

    def command(self, name: str, *args: Any) -> Future[Any]:
        """EngineCore.command's named calls (slot actions, cache reset), run now."""
        return self.call(lambda: getattr(self, name)(*args))

    # llama-server's slot actions and prompt-cache reset: a block-diffusion model keeps no KV between
    # requests, so a slot action is a 400 naming why and a reset resets nothing.
    def save_slot(self, slot_id: int, filename: str) -> Any:
        raise ValueError("a block-diffusion model keeps no slot KV to save or restore")

    restore_slot = save_slot

    def erase_slot(self, slot_id: int) -> int:
        raise ValueError("a block-diffusion model keeps no slot KV to erase")

    def reset_prefix_cache(self) -> PrefixCacheReset:
        return PrefixCacheReset(is_reset=False)

    def warm(self) -> float:
        """One block with one denoising step before the first request (A6); the seconds it took."""
        started = time.monotonic()
        token = min(self.eos_token_ids) if self.eos_token_ids else 0
        with torch.inference_mode():
            self.model.generate(torch.tensor([[token]], device=self.device), max_new_tokens=1, max_denoising_steps=1)
        return time.monotonic() - started

    def stop(self, timeout: float | None = None) -> bool:
        """Refuse new requests, abort queued and running ones, join the thread (A7)."""
        with self._lock:
            self._is_stopping = True
            queued, self._queue = list(self._queue), collections.deque()
            if self._current is not None:
                self._current.is_aborted = True
            for job in queued:
                self._finish(job, FinishReason.ABORT)
            self._lock.notify_all()
        if not self._thread.is_alive():
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stats(self) -> EngineStats:
        with self._lock:
            counts, current, waiting = self._counts, self._current, len(self._queue)
            slot = SlotStats(0, current is not None, current.request.request_id if current else None,
                             current.num_prompt_tokens if current else 0, current.num_sent if current else 0,
                             self.slot_context)
            return EngineStats(
                active_sequences=int(current is not None), queue_depth=waiting, max_batch_size=1,
                sequences_started=counts.started, sequences_completed=counts.completed, tokens_generated=counts.tokens,
                prompt_tokens_processed=counts.prompt_tokens, context_size=self.slot_context, slots=(slot,),
                prefix_cache=PrefixCacheStats(is_enabled=False), sequences_aborted=counts.aborted,
                is_alive=self.is_alive, num_steps=counts.steps, num_busy_slot_steps=counts.steps,
                max_sequence_len=counts.max_len,
                diffusion=DiffusionStats(self.options.sampler, self.canvas_length, counts.blocks, counts.steps,
                                         counts.timed_out, waiting, self.config.max_queue_depth))

    # --- the worker thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._is_stopping:
                    self._lock.wait()
                if self._is_stopping:
                    return
                job = self._queue.popleft()
                self._current = job
            try:
                self._serve(job)
            except BaseException as exc:  # noqa: BLE001 - this request fails; the worker keeps serving
                log.exception("block-diffusion request %s failed", job.request.request_id)
                with self._lock:
                    self._finish(job, FinishReason.ERROR, error=f"block diffusion failed: {exc}")
            finally:
                with self._lock:
                    self._current = None

    def _serve(self, job: _Job) -> None:
        if time.monotonic() > job.deadline:
            with self._lock:
                self._finish(job, FinishReason.ERROR, error=self._late_message("in the queue"),
                             status=GATEWAY_TIMEOUT)
            return
        sampling = job.request.sampling
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        job.started_at = time.monotonic()
        with self._lock:
            self._counts.started += 1
            self._counts.prompt_tokens += job.num_prompt_tokens
        prompt, kwargs = list(job.request.prompt_token_ids), {}
        if job.request.images and self.vision is not None:
            prompt, kwargs = self.vision.prepare(prompt, job.request.images)
            kwargs = {name: value.to(self.device) for name, value in kwargs.items()}
            if len(prompt) + self.canvas_length > self.slot_context:
                with self._lock:
                    self._finish(job, FinishReason.ERROR, error=str(ContextOverflowError(len(prompt), self.slot_context)),
                                 status=400)
                return
            job.num_prompt_tokens = len(prompt)
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        max_new = max(1, min(sampling.max_tokens or self.canvas_length, self.slot_context - len(prompt)))
        end_ids = None if sampling.ignore_eos else sorted(self.eos_token_ids) or None  # ignore_eos: run to max_tokens
        kwargs |= {"max_new_tokens": max_new, "eos_token_id": end_ids}
        if self.options.max_denoising_steps:
            kwargs["max_denoising_steps"] = self.options.max_denoising_steps
        try:
            with torch.inference_mode():
                self.model.generate(ids, streamer=_BlockStreamer(self, job), **kwargs)
        except _Stop:
            pass
        with self._lock:
            if not job.is_done:  # generate ran its blocks out without an end token: the length limit
                self._finish(job, FinishReason.ABORT if job.is_aborted else FinishReason.LENGTH)

    def count_step(self, job: _Job) -> None:
        """One denoising step ran; stop at once when the request was aborted or is past its deadline."""
        with self._lock:
            self._counts.steps += 1
            self._check_running(job)

    def commit_block(self, job: _Job, block: list[int]) -> None:
        """A block is final: send its tokens up to an end token or max_tokens as one event."""
        limit = job.request.sampling.max_tokens
        with self._lock:
            self._counts.blocks += 1
            self._check_running(job)
            tokens: list[int] = []
            reason: FinishReason | None = None
            for token in block:
                tokens.append(token)
                if token in self.eos_token_ids and not job.request.sampling.ignore_eos:
                    reason = FinishReason.STOP
                    break
                if limit is not None and job.num_sent + len(tokens) >= limit:
                    reason = FinishReason.LENGTH
                    break
            job.num_sent += len(tokens)
            self._counts.tokens += len(tokens)
            self._emit(job, TokenEvent(job.request.request_id, tuple(tokens), finish_reason=reason,
                                       num_prompt_tokens=job.num_prompt_tokens))
            if reason is not None:
                self._done(job, reason)
                raise _Stop

    def _check_running(self, job: _Job) -> None:
        if job.is_aborted:
            self._finish(job, FinishReason.ABORT)
            raise _Stop
        if time.monotonic() > job.deadline:
            self._finish(job, FinishReason.ERROR, error=self._late_message("while denoising"), status=GATEWAY_TIMEOUT)
            raise _Stop

    def _late_message(self, where: str) -> str:
        return (f"the block-diffusion request passed its {self.options.request_timeout_s:g} s deadline {where} "
                "(--diffusion-request-timeout)")

    # --- under the lock ---

    def _emit(self, job: _Job, event: TokenEvent) -> None:
        try:
            job.sink(event)
        except Exception:  # noqa: BLE001 - a dead listener must not stop the worker
            log.exception("block-diffusion sink failed for %s", job.request.request_id)

    def _finish(self, job: _Job, reason: FinishReason, *, error: str | None = None, status: int = 500) -> None:
        if job.is_done:
            return
        if status == GATEWAY_TIMEOUT:
            self._counts.timed_out += 1
        self._emit(job, TokenEvent(job.request.request_id, (), finish_reason=reason, error=error,
                                   error_status=status, num_prompt_tokens=job.num_prompt_tokens))
        self._done(job, reason)

    def _done(self, job: _Job, reason: FinishReason) -> None:
        job.is_done = True
        self._jobs.pop(job.request.request_id, None)
        self._counts.max_len = max(self._counts.max_len, job.num_prompt_tokens + job.num_sent)
        if reason is FinishReason.ABORT:
            self._counts.aborted += 1 if job.started_at else 0
        elif job.started_at:
            self._counts.completed += 1
