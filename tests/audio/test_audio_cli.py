"""The audio CLI paths (spec G): `mlxcel serve -m whisper-tiny.en` as a real process (audio-only, 501s,
SIGTERM joins the audio worker), and `mlxcel generate --output-audio` / `--audio` round trip."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from mlxcel.cli import main
from tests.audio.conftest import MAX_WER, SENTENCES, word_error_rate
from tests.server.test_process import read_address

pytestmark = pytest.mark.slow


def test_audio_only_process_serves_and_exits_clean(tmp_path: Path, speak: Callable[[str], Path]) -> None:
    command = [sys.executable, "-c", "import sys; from mlxcel.cli import main; sys.exit(main())", "serve",
               "-m", "whisper-tiny.en", "--port", "0", "--audio-queue-depth", "2", "--log-file",
               str(tmp_path / "server.log")]
    env = {**os.environ, "MLXCEL_AUDIO_REQUEST_TIMEOUT_SECS": "300"}
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    log: list[str] = []
    try:
        address = read_address(process, log, timeout=300)
        with speak(SENTENCES[2]).open("rb") as handle:
            response = httpx.post(f"{address}/v1/audio/transcriptions", files={"file": ("a.wav", handle)},
                                  data={"model": "whisper-1"}, timeout=300)
        assert word_error_rate(SENTENCES[2], response.json()["text"]) <= MAX_WER
        chat = httpx.post(f"{address}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 501 and chat.json()["error"]["mode"] == "audio-only"
        assert httpx.get(f"{address}/health").json()["providers"][0]["max_queue_depth"] == 2
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = (tmp_path / "server.log").read_text()
    assert "audio-only process" in text and "shutdown complete" in text


def test_generate_speaks_and_transcribes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sentence = "The library opens at ten in the morning."
    out = tmp_path / "spoken.wav"
    assert main(["generate", "-m", "en_US-joe-medium", "-p", sentence, "--output-audio", str(out)]) == 0
    assert out.stat().st_size > 10_000
    capsys.readouterr()
    assert main(["generate", "-m", "whisper-tiny.en", "--audio", str(out)]) == 0
    captured = capsys.readouterr()
    assert word_error_rate(sentence, captured.out) <= MAX_WER and "real-time factor" in captured.err
    assert main(["generate", "-m", "whisper-tiny.en", "--audio", str(tmp_path / "missing.wav")]) == 1
