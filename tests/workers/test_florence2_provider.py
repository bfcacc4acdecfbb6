"""The Florence-2 provider (spec T): task prompts checked before any work, and the worker's answer equal
to transformers' own greedy run and post-processing on a tiny random checkpoint of the real architecture."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from PIL import Image

from mlxcel.workers.base import WorkerTimeoutError
from mlxcel.workers.florence2 import (
    PHRASE_TASKS, PLAIN_TASKS, REGION_TASKS, TASKS, Florence2Config, Florence2Job, Florence2Provider, TaskError,
    TaskPrompt, is_florence2_checkpoint, parse_task_prompt,
)
from tests.workers.tiny_florence2 import NUM_IMAGE_TOKENS, write_tiny_florence2

REGION = "<loc_10><loc_20><loc_500><loc_600>"


@pytest.fixture(scope="module")
def florence2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_florence2(tmp_path_factory.mktemp("florence2"))


@pytest.fixture(scope="module")
def provider(florence2_dir: Path) -> Iterator[Florence2Provider]:
    provider = Florence2Provider.load(florence2_dir, Florence2Config(max_queue_depth=2, request_timeout_s=60))
    yield provider
    assert provider.stop(30)


def test_fifteen_tasks_seven_of_them_take_text() -> None:
    assert len(TASKS) == len(set(TASKS)) == 15
    assert len(PHRASE_TASKS) + len(REGION_TASKS) == 7 and len(PLAIN_TASKS) == 8


@pytest.mark.parametrize(("prompt", "parsed"), [
    ("<OD>", TaskPrompt("<OD>")),
    ("  <CAPTION>\n", TaskPrompt("<CAPTION>")),
    ("<OPEN_VOCABULARY_DETECTION>a red car", TaskPrompt("<OPEN_VOCABULARY_DETECTION>", "a red car")),
    ("<CAPTION_TO_PHRASE_GROUNDING> A green tree. ", TaskPrompt("<CAPTION_TO_PHRASE_GROUNDING>", "A green tree.")),
    (f"<REGION_TO_CATEGORY>{REGION}", TaskPrompt("<REGION_TO_CATEGORY>", REGION)),
    ("<REGION_TO_OCR><loc_0><loc_0><loc_999><loc_999>", TaskPrompt("<REGION_TO_OCR>",
                                                                   "<loc_0><loc_0><loc_999><loc_999>")),
])
def test_valid_task_prompts(prompt: str, parsed: TaskPrompt) -> None:
    assert parse_task_prompt(prompt) == parsed


@pytest.mark.parametrize(("prompt", "named"), [
    ("<FOO>", "unknown Florence-2 task <FOO>"),
    ("<od>", "unknown Florence-2 task <od>"),
    ("describe this", "must start with a Florence-2 task token"),
    ("", "must start with a Florence-2 task token"),
    ("<OD> and more", "<OD> takes no text"),
    ("<OPEN_VOCABULARY_DETECTION>", "needs text after the task token"),
    ("<REFERRING_EXPRESSION_SEGMENTATION>   ", "needs text after the task token"),
    ("<CAPTION_TO_PHRASE_GROUNDING>a <OD> car", "may not hold a special token"),
    ("<OPEN_VOCABULARY_DETECTION>" + "x" * 2001, "over 2000"),
    ("<REGION_TO_CATEGORY>", "needs a region"),
    ("<REGION_TO_DESCRIPTION>a car", "needs a region"),
    ("<REGION_TO_SEGMENTATION><loc_1><loc_2><loc_3>", "needs a region"),
    ("<REGION_TO_OCR><loc_1><loc_2><loc_3><loc_1000>", "needs a region"),
    ("<REGION_TO_CATEGORY><loc_500><loc_2><loc_3><loc_4>", "first corner"),
])
def test_bad_task_prompts_name_the_problem(prompt: str, named: str) -> None:
    with pytest.raises(TaskError, match=re.escape(named)):
        parse_task_prompt(prompt)


def test_the_checkpoint_is_told_by_its_config(florence2_dir: Path, tmp_path: Path) -> None:
    assert is_florence2_checkpoint(florence2_dir)
    assert not is_florence2_checkpoint(tmp_path) and not is_florence2_checkpoint(florence2_dir / "config.json")


def reference(folder: Path, prompt: str, image: Image.Image, max_new_tokens: int) -> tuple[dict, list[int], int]:
    """transformers' own run: greedy generate, decode, post_process_generation."""
    from transformers import AutoProcessor, Florence2ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder)
    model = Florence2ForConditionalGeneration.from_pretrained(folder).eval()
    inputs = processor(text=prompt, images=image, return_tensors="pt")
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1)[0].tolist()
    text = processor.batch_decode([output], skip_special_tokens=False)[0]
    task = parse_task_prompt(prompt).task
    return processor.post_process_generation(text, task=task, image_size=image.size), output, inputs[
        "input_ids"].shape[1]


@pytest.mark.parametrize("prompt", ["<OD>", "<CAPTION>", f"<REGION_TO_DESCRIPTION>{REGION}",
                                    "<OPEN_VOCABULARY_DETECTION>a red car"])
def test_answer_is_transformers_own(provider: Florence2Provider, florence2_dir: Path, prompt: str) -> None:
    image = Image.new("RGB", (64, 48), (200, 30, 10))
    answer = asyncio.run(provider.run(Florence2Job(parse_task_prompt(prompt), image, 12)))
    result, output, prompt_len = reference(florence2_dir, prompt, image, 12)
    assert answer.result == result
    value = result[answer.task]
    assert answer.content == value if isinstance(value, str) else answer.content.startswith("{")
    assert answer.prompt_tokens == prompt_len > NUM_IMAGE_TOKENS  # image tokens and the prompt's, fused
    assert answer.completion_tokens == len(output) - 1 == 12 and answer.finish_reason == "length"
    assert provider.stats().num_completed >= 1 and provider.stats().max_queue_depth == 2


STEP_S = 0.05  # a decoding step made at least this slow: 255 steps cannot fit a 0.3 s deadline, whatever the load


def test_issue47_a_request_past_its_deadline_stops_decoding_at_the_next_step(florence2_dir: Path) -> None:
    own = Florence2Provider.load(florence2_dir, Florence2Config(max_queue_depth=1, request_timeout_s=0.3))
    steps: list[int] = []

    def slow_step(module: torch.nn.Module, args: tuple[object, ...]) -> None:
        steps.append(1)  # the head runs once per decoding step
        time.sleep(STEP_S)

    own.model.lm_head.register_forward_pre_hook(slow_step)
    job = Florence2Job(parse_task_prompt("<OD>"), Image.new("RGB", (64, 48), (200, 30, 10)), own.max_new_tokens)
    with pytest.raises(WorkerTimeoutError):
        asyncio.run(own.run(job))
    assert own.stop(60)  # joins once the decoding stopped
    assert 0 < len(steps) < own.max_new_tokens  # it stopped between steps, not after all 255
    stats = own.stats()
    assert (stats.num_timed_out, stats.num_failed, stats.num_completed) == (1, 0, 0)
