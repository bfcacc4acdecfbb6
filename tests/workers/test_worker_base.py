"""BatchWorker (spec I, A7): a full queue refuses (503), a late request times out (504),
queued requests share batches, a failing forward fails only its requests, stop joins.

Deterministic: the forward blocks on an Event, so the test knows where every request is.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from mlxcel.workers.base import (
    BatchWorker,
    WorkerBusyError,
    WorkerConfig,
    WorkerStoppedError,
    WorkerTimeoutError,
)


class GatedForward:
    """Doubles its inputs; the first call waits for `release` after setting `entered`."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.batches: list[list[int]] = []

    def __call__(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        self.entered.set()
        assert self.release.wait(10), "the test never released the forward"
        if any(item < 0 for item in items):
            raise ValueError("negative input")
        return [2 * item for item in items]


@pytest.fixture
def gate() -> Iterator[GatedForward]:
    forward = GatedForward()
    yield forward
    forward.release.set()  # never leave a worker thread blocked


def start(forward: GatedForward, **config: float) -> BatchWorker[int, int]:
    worker_config = WorkerConfig(**config)  # type: ignore[arg-type]
    worker: BatchWorker[int, int] = BatchWorker("test", forward, worker_config, sort_key=lambda x: x)
    worker.start()
    return worker


def test_I_full_queue_raises_busy(gate: GatedForward) -> None:
    worker = start(gate, queue_depth=1, batch_size=1)
    running = worker.submit([1])
    assert gate.entered.wait(5)  # the thread holds request 1; the queue is empty
    queued = worker.submit([2])
    with pytest.raises(WorkerBusyError, match="queue is full"):
        worker.submit([3])
    assert worker.stats().num_rejected == 1 and worker.stats().queue_depth == 1
    gate.release.set()
    assert running.result(5) == [2] and queued.result(5) == [4]
    assert worker.stop(5)


def test_I_request_past_its_deadline_times_out(gate: GatedForward) -> None:
    worker = start(gate, queue_depth=2, batch_size=1, request_timeout_s=0.2)

    async def scenario() -> None:
        with pytest.raises(WorkerTimeoutError, match="longer than 0.2 s"):
            await worker.run([1])

    asyncio.run(scenario())
    assert worker.stats().num_timed_out == 1
    gate.release.set()
    assert worker.stop(5)


def test_I_a_request_that_expired_in_the_queue_is_never_computed(gate: GatedForward) -> None:
    worker = start(gate, queue_depth=2, batch_size=1, request_timeout_s=0.2)
    first = worker.submit([1])
    assert gate.entered.wait(5)
    with pytest.raises(WorkerTimeoutError):
        worker.run_sync([5])  # waits behind the blocked forward past its deadline
    gate.release.set()
    with pytest.raises(WorkerTimeoutError):  # its forward ended past its deadline too (issue 47): no late answer
        first.result(5)
    assert worker.stop(5)
    assert [5] not in gate.batches
    assert worker.stats().num_timed_out == 2 and worker.stats().num_completed == 0


class StepForward:
    """A forward of many short steps that asks the worker between them whether anyone still waits."""

    def __init__(self, num_steps: int) -> None:
        self.num_steps = num_steps
        self.steps_run = 0
        self.worker: BatchWorker[int, int] | None = None

    def __call__(self, items: list[int]) -> list[int]:
        assert self.worker is not None
        for _ in range(self.num_steps):
            if self.worker.is_past_deadline():
                raise RuntimeError("stopped between steps")
            time.sleep(0.01)  # each step takes at least this, so all of them outlast the deadline
            self.steps_run += 1
        return items


def test_issue47_an_answer_finished_past_its_deadline_is_a_504_not_a_late_result() -> None:
    """Whatever the load: the forward returns only once the deadline has passed, and nobody waits with a timer."""
    worker: BatchWorker[int, int] | None = None

    def late_forward(items: list[int]) -> list[int]:
        assert worker is not None
        while not worker.is_past_deadline():
            time.sleep(0.01)
        return items

    worker = BatchWorker("test", late_forward, WorkerConfig(queue_depth=1, batch_size=1, request_timeout_s=0.2))
    worker.start()
    future = worker.submit([1])
    with pytest.raises(WorkerTimeoutError, match="longer than 0.2 s"):
        future.result(30)
    stats = worker.stats()
    assert (stats.num_timed_out, stats.num_completed, stats.num_failed) == (1, 0, 0)
    assert worker.stop(5)


def test_issue47_a_forward_stops_between_steps_at_the_deadline_and_is_counted_once() -> None:
    forward = StepForward(num_steps=100_000)  # at least 1,000 s of steps against a 0.2 s deadline
    worker: BatchWorker[int, int] = BatchWorker("test", forward, WorkerConfig(1, 1, 0.2))
    forward.worker = worker
    worker.start()

    async def scenario() -> None:
        with pytest.raises(WorkerTimeoutError):
            await worker.run([1])

    asyncio.run(scenario())  # the waiter's timer and the worker thread both see the deadline
    assert worker.stop(30)  # joins once the forward stopped: it did not run its 100,000 steps
    assert forward.steps_run < forward.num_steps
    stats = worker.stats()
    assert (stats.num_timed_out, stats.num_failed, stats.num_completed) == (1, 0, 0)


def test_I_queued_requests_share_one_forward_up_to_the_batch_size(gate: GatedForward) -> None:
    worker = start(gate, queue_depth=4, batch_size=4)
    blocker = worker.submit([1])
    assert gate.entered.wait(5)
    futures = [worker.submit([30, 10]), worker.submit([20, 40]), worker.submit([7, 6])]
    gate.release.set()
    assert [f.result(5) for f in futures] == [[60, 20], [40, 80], [14, 12]]
    assert blocker.result(5) == [2]
    # Two requests fill a batch of 4 (sorted by the key), the third runs next.
    assert gate.batches == [[1], [10, 20, 30, 40], [6, 7]]
    worker.stop(5)


def test_I_a_failing_forward_fails_only_its_request(gate: GatedForward) -> None:
    gate.release.set()
    worker = start(gate, queue_depth=2, batch_size=1)
    with pytest.raises(ValueError, match="negative input"):
        worker.run_sync([-1])
    assert worker.run_sync([3]) == [6]
    stats = worker.stats()
    assert (stats.num_failed, stats.num_completed) == (1, 1)
    worker.stop(5)


def test_A7_stop_fails_queued_requests_and_joins(gate: GatedForward) -> None:
    worker = start(gate, queue_depth=2, batch_size=1)
    running = worker.submit([1])
    assert gate.entered.wait(5)
    queued = worker.submit([2])
    assert not worker.stop(timeout=0.1)  # the forward is still running: not a clean exit
    with pytest.raises(WorkerStoppedError):
        queued.result(5)
    with pytest.raises(WorkerStoppedError):
        worker.submit([3])
    gate.release.set()
    assert running.result(5) == [2]  # the batch in flight still finishes
    assert worker.stop(5)


def test_I_empty_request_is_refused(gate: GatedForward) -> None:
    worker = start(gate)
    with pytest.raises(ValueError, match="at least one input"):
        worker.submit([])
    worker.stop(5)
