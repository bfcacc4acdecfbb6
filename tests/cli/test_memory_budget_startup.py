"""MLXCEL_REQUEST_MEMORY_BUDGET (O) at startup, through `mlxcel serve` (issue 26 point 8): a budget
that holds no KV block is refused in one line naming the minimum (exit 2, no traceback); a budget
below what the warmup would use is served, the warmup cut to fit it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.loading.tiny_checkpoint import tiny_llama_files, write_files
from tests.server.test_process import read_address

pytestmark = pytest.mark.slow
MINIMUM = re.compile(r"the minimum is (\d+) bytes")


def serve_command(model: Path) -> list[str]:
    return [sys.executable, "-m", "mlxcel.cli", "serve", "-m", str(model), "--port", "0", "-c", "256", "-np", "1"]


def budget_env(budget: str) -> dict[str, str]:
    return {**os.environ, "MLXCEL_REQUEST_MEMORY_BUDGET": budget, "OMP_NUM_THREADS": "1"}


def test_o_budget_below_one_block_is_refused_and_one_block_is_served(tmp_path: Path) -> None:
    model = write_files(tmp_path / "tiny", tiny_llama_files())
    refused = subprocess.run(serve_command(model), env=budget_env("1"), capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    [line] = [line for line in refused.stderr.splitlines() if "ERROR" in line]
    assert "cannot start: MLXCEL_REQUEST_MEMORY_BUDGET: 1 bytes cannot hold one KV block" in line
    minimum = int(MINIMUM.search(line).group(1))  # type: ignore[union-attr]

    # One block (16 tokens) is below the warmup's prompt and output: the warmup shrinks to fit it.
    process = subprocess.Popen(serve_command(model), env=budget_env(str(minimum)), stderr=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    try:
        address = read_address(process, lines, timeout=240)
        assert any("warmup cut to 16 tokens" in line for line in lines), "".join(lines)
        small = httpx.post(address + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=60)
        assert small.status_code == 200, small.text
        big = httpx.post(address + "/v1/completions", json={"prompt": "hello " * 20, "max_tokens": 2}, timeout=60)
        assert big.status_code == 503 and big.json()["error"]["code"] == "request_memory_budget_exceeded"
        process.terminate()
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert "Traceback" not in "".join(lines)
