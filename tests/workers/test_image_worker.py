"""The image worker (spec J) in process: previews spread over the run, and an abort (timeout, client gone,
shutdown) ends a diffusion run at its next step instead of after all of them."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxcel.workers.base import WorkerConfig, WorkerTimeoutError
from mlxcel.workers.image import (
    ImageAborted, ImageConfig, ImageGenerator, ImageJob, ImageSpec, StepProgress, preview_steps,
)
from tests.workers.tiny_image_pipeline import write_tiny_pipeline

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def generator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ImageGenerator]:
    loaded = ImageGenerator.load(write_tiny_pipeline(tmp_path_factory.mktemp("image") / "tiny-sd"), ImageConfig())
    yield loaded
    assert loaded.stop(30.0)


def test_j_previews_are_spread_over_the_steps() -> None:
    assert preview_steps(10, 0) == {}
    assert preview_steps(10, 1) == {5: 0}
    assert preview_steps(12, 3) == {3: 0, 6: 1, 9: 2}
    assert preview_steps(2, 3) == {1: 0, 2: 1}  # fewer steps than previews: one per step, indexes in order


def test_j_an_aborted_job_stops_at_its_next_step(generator: ImageGenerator) -> None:
    seen: list[StepProgress] = []

    def on_step(progress: StepProgress) -> None:
        seen.append(progress)
        job.abort.set()  # as a timeout or a gone client does

    job = ImageJob(ImageSpec("a tree", width=16, height=16, steps=200, seed=1), on_step=on_step)
    with pytest.raises(ImageAborted):
        generator.run_sync(job)
    assert [(p.step, p.num_steps) for p in seen] == [(1, 200)]
    again = generator.run_sync(ImageJob(ImageSpec("a tree", width=16, height=16, steps=2, seed=1)))
    assert len(again) == 1 and again[0].data.startswith(b"\x89PNG")


def test_j_stop_ends_the_running_job(tmp_path: Path) -> None:
    own = ImageGenerator.load(write_tiny_pipeline(tmp_path / "tiny-sd"), ImageConfig())
    started = threading.Event()
    job = ImageJob(ImageSpec("a tree", width=32, height=32, steps=500, seed=1), on_step=lambda _: started.set())
    future = own.submit(job)
    assert started.wait(60)
    begin = time.monotonic()
    assert own.stop(60.0)  # A7: joined without waiting out the 500 steps
    assert time.monotonic() - begin < 30 and isinstance(future.exception(), ImageAborted)


@pytest.mark.slow
def test_issue47_a_job_past_its_deadline_stops_at_its_next_step_and_is_a_504(tmp_path: Path) -> None:
    config = ImageConfig(worker=WorkerConfig(queue_depth=1, batch_size=1, request_timeout_s=0.5))
    own = ImageGenerator.load(write_tiny_pipeline(tmp_path / "tiny-sd"), config)
    seen: list[int] = []

    def slow_step(progress: StepProgress) -> None:
        seen.append(progress.step)
        time.sleep(0.05)  # 500 steps of at least this cannot fit the 0.5 s deadline, whatever the load

    future = own.submit(ImageJob(ImageSpec("a tree", width=16, height=16, steps=500, seed=1), on_step=slow_step))
    with pytest.raises(WorkerTimeoutError):  # the worker's own answer: nobody waits on a timer here
        future.result(120)
    assert len(seen) < 500
    assert own.stats().num_timed_out == 1 and own.stats().num_failed == 0
    assert own.stop(30.0)
