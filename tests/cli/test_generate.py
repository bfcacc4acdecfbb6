"""`mlxcel generate` (A10): generated text on stdout only, speeds on stderr."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_a10_generate_streams_text_to_stdout_and_speed_to_stderr() -> None:
    done = subprocess.run([sys.executable, "-m", "mlxcel.cli", "generate", "-p", "Hi", "--chat", "--max-tokens", "4",
                           "--temp", "0", "-c", "512"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Hello") and not done.stdout.endswith("\n")
    assert "tokens/s" not in done.stdout
    assert "prompt:" in done.stderr and "generation: 4 tokens" in done.stderr and "tokens/s" in done.stderr
