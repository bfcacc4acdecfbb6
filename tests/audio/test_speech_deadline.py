"""The speech worker holds its request deadline itself (issue 47): past it, the voice stops at the next
sentence and the request is a 504 from the worker, not a late answer. The real Piper voice, a job of forty
sentences whose listener takes at least 50 ms a chunk: it cannot finish in 0.5 s whatever the load."""

from __future__ import annotations

import time

import numpy as np
import pytest

from mlxcel.serving.audio_models import AudioModels
from mlxcel.workers.base import WorkerConfig, WorkerTimeoutError
from mlxcel.workers.speech import SpeechConfig, SpeechJob, SpeechSynthesizer

pytestmark = pytest.mark.slow
NUM_SENTENCES = 40


def test_issue47_speech_past_its_deadline_stops_at_the_next_sentence(piper: AudioModels) -> None:
    assert piper.synthesizer is not None
    voice = piper.synthesizer.voice  # the loaded voice, run by a worker of its own with a 0.5 s deadline
    own = SpeechSynthesizer(voice, SpeechConfig(worker=WorkerConfig(queue_depth=1, batch_size=1,
                                                                    request_timeout_s=0.5)))
    own.start()
    chunks: list[int] = []

    def slow_listener(chunk: np.ndarray) -> None:
        chunks.append(chunk.size)
        time.sleep(0.05)

    text = " ".join(f"This is sentence number {i}." for i in range(NUM_SENTENCES))
    future = own.submit(SpeechJob(text, voice.voices[0], 1.0, slow_listener))
    with pytest.raises(WorkerTimeoutError):  # the worker's own answer: nobody waits on a timer here
        future.result(120)  # type: ignore[attr-defined]
    assert len(chunks) < NUM_SENTENCES
    assert own.stats().num_timed_out == 1 and own.stats().num_failed == 0
    assert own.stop(30)
