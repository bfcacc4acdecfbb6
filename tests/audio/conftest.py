"""Audio fixtures: speech made for the test with eSpeak NG, the packaged checkpoints loaded once.

`speak(text)` renders English speech to WAV with espeak-ng (a Debian package `make setup`
installs); the tests compare what Whisper hears with the words spoken by word error rate.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mlxcel.serving.audio_models import AudioModels, AudioOptions, find_audio_checkpoint, load_audio_models
from mlxcel.loading import resolve_model

SENTENCES = (
    "Turn left at the next corner and walk two blocks to the bank.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "The weather today is sunny with a light breeze from the west.",
)
MAX_WER = 0.25  # tiny.en on espeak-ng's robotic voice: measured 0.0 on each of SENTENCES; 0.25 leaves room


def word_error_rate(reference: str | list[str], hypothesis: str | list[str]) -> float:
    """WER after lower-casing and dropping punctuation; lists are scored as one corpus."""
    import jiwer

    transform = jiwer.Compose([jiwer.ToLowerCase(), jiwer.RemovePunctuation(), jiwer.RemoveMultipleSpaces(),
                               jiwer.Strip(), jiwer.ReduceToListOfListOfWords()])
    return float(jiwer.wer(reference, hypothesis, reference_transform=transform, hypothesis_transform=transform))


@pytest.fixture(scope="session")
def speak(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """English speech as a 22.05 kHz WAV file, by espeak-ng."""
    binary = shutil.which("espeak-ng")
    if binary is None:
        pytest.fail("espeak-ng is not installed: run scripts/setup.sh (apt-get install espeak-ng)")
    folder = tmp_path_factory.mktemp("speech")
    made: dict[str, Path] = {}

    def render(text: str) -> Path:
        if text not in made:
            path = folder / f"clip{len(made)}.wav"
            subprocess.run([binary, "-v", "en-us", "-s", "150", "-w", str(path), text], check=True, timeout=60)
            made[text] = path
        return made[text]

    return render


def load(name: str, options: AudioOptions = AudioOptions(threads=2)) -> AudioModels:
    found = find_audio_checkpoint(name, resolve_model)
    assert found is not None, name
    return load_audio_models(found, options, int(time.time()))


@pytest.fixture(scope="session")
def whisper() -> Iterator[AudioModels]:
    models = load("whisper-tiny.en")
    yield models
    assert models.stoppers[0][1](30)


@pytest.fixture(scope="session")
def piper() -> Iterator[AudioModels]:
    models = load("en_US-joe-medium")
    yield models
    assert models.stoppers[0][1](30)


@pytest.fixture(scope="session")
def kokoro() -> Iterator[AudioModels]:
    models = load("kokoro-82m")
    yield models
    assert models.stoppers[0][1](30)
