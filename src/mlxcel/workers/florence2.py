"""The Florence-2 provider (spec T): an encoder-decoder vision model behind a single-stream worker.

Florence-2 is not a decoder the batch scheduler can page, so it runs on its own thread, one
request at a time, through transformers' `Florence2ForConditionalGeneration` and
`Florence2Processor`: the task prompt and image become the fused encoder input, decoding is
greedy, and the processor's `post_process_generation` parses the answer (boxes, polygons,
quad boxes, labels). `--max-queue-depth` bounds the requests waiting behind the running one
(503 past it); `--decode-timeout` bounds a request from arrival to answer (504), checked after
every decoding step too, so a request past it stops decoding and never turns into a late 200.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlxcel.loading.errors import ModelLoadError
from mlxcel.workers.base import BatchWorker, WorkerBusyError, WorkerConfig, WorkerStats, WorkerTimeoutError

log = logging.getLogger(__name__)

MODEL_TYPE = "florence2"
# The tasks whose prompt is the task token alone (the processor's own list).
PLAIN_TASKS = ("<CAPTION>", "<DETAILED_CAPTION>", "<MORE_DETAILED_CAPTION>", "<OCR>", "<OCR_WITH_REGION>", "<OD>",
               "<DENSE_REGION_CAPTION>", "<REGION_PROPOSAL>")
# The seven that take text after the token: a phrase, or a region as four location tokens.
PHRASE_TASKS = ("<CAPTION_TO_PHRASE_GROUNDING>", "<REFERRING_EXPRESSION_SEGMENTATION>", "<OPEN_VOCABULARY_DETECTION>")
REGION_TASKS = ("<REGION_TO_SEGMENTATION>", "<REGION_TO_CATEGORY>", "<REGION_TO_DESCRIPTION>", "<REGION_TO_OCR>")
TASKS = PLAIN_TASKS + PHRASE_TASKS + REGION_TASKS
MAX_INPUT_CHARS = 2000  # a phrase longer than this is no grounding query (the encoder window bounds it too)
NUM_LOCATION_BINS = 1000  # <loc_0> .. <loc_999>, the processor's quantization

_TASK_TOKEN = re.compile(r"^<[A-Za-z0-9_]+>")
_ANY_TOKEN = re.compile(r"<[A-Za-z0-9_/]+>")
_REGION = re.compile(r"^<loc_(\d{1,3})><loc_(\d{1,3})><loc_(\d{1,3})><loc_(\d{1,3})>$")


class TaskError(ValueError):
    """A task prompt the model cannot run; the server answers 400 with its message."""


@dataclass(frozen=True, slots=True)
class TaskPrompt:
    task: str  # "<OD>"
    text: str = ""  # the input of a phrase or region task

    @property
    def prompt(self) -> str:
        return self.task + self.text


def parse_task_prompt(prompt: str) -> TaskPrompt:
    """Split and check `<TASK>text`: a known task token, and text only where the task takes it."""
    stripped = prompt.strip()
    match = _TASK_TOKEN.match(stripped)
    if match is None:
        raise TaskError(f"the prompt must start with a Florence-2 task token such as <CAPTION> or <OD>, not "
                        f"{stripped[:40]!r}; tasks: {', '.join(TASKS)}")
    task, text = match.group(0), stripped[match.end():].strip()
    if task not in TASKS:
        raise TaskError(f"unknown Florence-2 task {task}; tasks: {', '.join(TASKS)}")
    if task in PLAIN_TASKS and text:
        raise TaskError(f"{task} takes no text after the task token (got {text[:40]!r})")
    if task in PHRASE_TASKS:
        _check_phrase(task, text)
    if task in REGION_TASKS:
        _check_region(task, text)
    return TaskPrompt(task, text)


def _check_phrase(task: str, text: str) -> None:
    if not text:
        raise TaskError(f"{task} needs text after the task token, e.g. {task}a red car")
    if len(text) > MAX_INPUT_CHARS:
        raise TaskError(f"{task}: the text is {len(text)} characters, over {MAX_INPUT_CHARS}")
    token = _ANY_TOKEN.search(text)
    if token is not None:
        raise TaskError(f"{task}: the text may not hold a special token such as {token.group(0)[:40]!r}")


def _check_region(task: str, text: str) -> None:
    match = _REGION.match(text)
    if match is None:
        raise TaskError(f"{task} needs a region after the task token: four location tokens "
                        f"<loc_x1><loc_y1><loc_x2><loc_y2> (0-{NUM_LOCATION_BINS - 1}), not {text[:60]!r}")
    x1, y1, x2, y2 = (int(value) for value in match.groups())
    if max(x1, y1, x2, y2) >= NUM_LOCATION_BINS:
        raise TaskError(f"{task}: location tokens run from <loc_0> to <loc_{NUM_LOCATION_BINS - 1}>")
    if x1 > x2 or y1 > y2:
        raise TaskError(f"{task}: the region's first corner must be above and left of its second")


def is_florence2_checkpoint(path: Path) -> bool:
    """A folder whose config.json names model_type florence2."""
    config = path / "config.json"
    if not path.is_dir() or not config.is_file():
        return False
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


@dataclass(frozen=True, slots=True)
class Florence2Config:
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    max_queue_depth: int = 64  # --max-queue-depth: waiting behind the running request (0 = none)
    request_timeout_s: float = 600.0  # --decode-timeout


@dataclass(frozen=True, slots=True)
class Florence2Job:
    task: TaskPrompt
    image: Any  # a decoded PIL image (the media layer checked its size)
    max_new_tokens: int


@dataclass(frozen=True, slots=True)
class Florence2Answer:
    task: str
    result: dict[str, Any]  # post_process_generation's {task: answer}
    content: str  # the answer as text: the string itself, or the parsed structure as JSON
    prompt_tokens: int  # the fused encoder length: image tokens + prompt tokens
    completion_tokens: int
    finish_reason: str  # "stop" (end token) or "length"


class Florence2Provider:
    """A loaded Florence-2 model and processor, and the one thread that runs them."""

    def __init__(self, model: Any, processor: Any, config: Florence2Config) -> None:
        self.model = model
        self.processor = processor
        self.config = config
        self.window = int(model.config.text_config.max_position_embeddings)  # encoder and decoder positions
        # The worker queue never fills: admission below counts the running request too, so depth 0 works.
        self._admitted = threading.BoundedSemaphore(config.max_queue_depth + 1)
        worker = WorkerConfig(config.max_queue_depth + 1, 1, config.request_timeout_s)
        self._worker: BatchWorker[Florence2Job, Florence2Answer] = BatchWorker("florence2", self._forward, worker)
        self._num_rejected = 0

    @classmethod
    def load(cls, folder: Path, config: Florence2Config) -> Florence2Provider:
        from transformers import AutoProcessor, Florence2ForConditionalGeneration

        try:
            processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
            model = Florence2ForConditionalGeneration.from_pretrained(folder, dtype=config.dtype,
                                                                      local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{folder}: transformers could not load it as Florence-2 ({exc})") from None
        provider = cls(model.to(config.device).eval(), processor, config)
        provider.start()
        return provider

    @property
    def default_max_tokens(self) -> int:
        return min(1024, self.max_new_tokens)

    @property
    def max_new_tokens(self) -> int:
        return self.window - 1  # the decoder start token takes the first position

    def start(self) -> None:
        self._worker.start()

    def stop(self, timeout: float | None = None) -> bool:
        return self._worker.stop(timeout)

    def stats(self) -> WorkerStats:
        stats = self._worker.stats()
        rejected = stats.num_rejected + self._num_rejected
        # The waiting ones: those admitted but not yet taken by the thread.
        return WorkerStats(stats.name, stats.queue_depth, self.config.max_queue_depth, stats.num_requests,
                           stats.num_completed, stats.num_failed, rejected, stats.num_timed_out)

    async def run(self, job: Florence2Job) -> Florence2Answer:
        """One job on the worker thread: 503 past the queue depth, 504 past the timeout."""
        if not self._admitted.acquire(blocking=False):
            self._num_rejected += 1
            raise WorkerBusyError(f"the florence2 queue is full ({self.config.max_queue_depth} requests waiting "
                                  "behind the running one); retry later")
        try:
            return (await self._worker.run([job]))[0]
        finally:
            self._admitted.release()

    # --- worker thread ---

    def _forward(self, jobs: list[Florence2Job]) -> list[Florence2Answer]:
        return [self._answer(job) for job in jobs]

    @torch.inference_mode()
    def _answer(self, job: Florence2Job) -> Florence2Answer:
        inputs = self.processor(text=job.task.prompt, images=job.image.convert("RGB"), return_tensors="pt")
        prompt_len = int(inputs["input_ids"].shape[1])
        if prompt_len > self.window:
            raise TaskError(f"the task text makes the encoder input {prompt_len} tokens (image tokens included), "
                            f"over the model's {self.window}")
        inputs = inputs.to(self.config.device)
        inputs["pixel_values"] = inputs["pixel_values"].to(self.config.dtype)
        # Greedy, as the spec says: no beams and no sampling, whatever the checkpoint's generation config holds.
        output = self.model.generate(**inputs, max_new_tokens=job.max_new_tokens, do_sample=False, num_beams=1,
                                     stopping_criteria=_deadline_stop(self._worker.is_past_deadline))
        return self._parse(job, output[0].tolist(), prompt_len)

    def _parse(self, job: Florence2Job, token_ids: list[int], prompt_len: int) -> Florence2Answer:
        generated = token_ids[1:]  # the decoder start token is not generated
        text = self.processor.batch_decode([token_ids], skip_special_tokens=False)[0]
        image = job.image
        result = self.processor.post_process_generation(text, task=job.task.task, image_size=(image.width,
                                                                                              image.height))
        result = _plain(result)
        answer = result[job.task.task]
        content = answer if isinstance(answer, str) else json.dumps(answer, ensure_ascii=False)
        # NOTE: a checkpoint's forced_eos_token_id ends a cut answer with </s> too, so the count decides.
        is_cut = len(generated) >= job.max_new_tokens
        return Florence2Answer(job.task.task, result, content, prompt_len, len(generated),
                               "length" if is_cut else "stop")


def _deadline_stop(is_late: Callable[[], bool]) -> Any:
    """A transformers stopping criterion asked after every decoding step: past the deadline it raises the 504
    (issue 47), so a request nobody waits for stops decoding at once."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class DeadlineStop(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            if is_late():
                raise WorkerTimeoutError("the florence2 request passed its --decode-timeout while decoding")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([DeadlineStop()])


def _plain(value: Any) -> Any:
    """The parsed answer as JSON values (tensors and tuples become lists, numpy scalars numbers)."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value
