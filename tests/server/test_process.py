"""The real `mlxcel-server` process: --port 0 address line (A4), LLAMA_ARG_* mirrors (A10), SIGTERM (A7)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from mlxcel.server.lifecycle import LISTENING_PREFIX

pytestmark = pytest.mark.slow
ADDRESS = re.compile(re.escape(LISTENING_PREFIX) + r"(\S+)")


def read_address(process: subprocess.Popen[str], log: list[str], timeout: float = 120.0) -> str:
    """Read stderr until the one parseable listening line; keep reading it on a thread afterwards."""
    end = time.monotonic() + timeout
    assert process.stderr is not None
    for line in process.stderr:
        log.append(line)
        match = ADDRESS.search(line)
        if match:
            threading.Thread(target=lambda: log.extend(process.stderr), daemon=True).start()  # type: ignore[arg-type]
            return match.group(1)
        if time.monotonic() > end:
            break
    raise AssertionError("no listening line:\n" + "".join(log))


def test_a7_sigterm_with_a_request_in_flight_exits_clean(tmp_path: Path) -> None:
    env = {**os.environ, "LLAMA_ARG_N_PARALLEL": "2", "LLAMA_ARG_PORT": "9", "LLAMA_ARG_ENDPOINT_METRICS": "1"}
    command = [sys.executable, "-c", "import sys; from mlxcel.cli import server_main; sys.exit(server_main())",
               "--port", "0", "-c", "1024", "--no-warmup", "--log-file", str(tmp_path / "server.log")]
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    log: list[str] = []
    try:
        address = read_address(process, log)
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", address) and not address.endswith(":9")  # CLI wins
        health = httpx.get(address + "/health").json()
        assert health["batch"]["max_batch_size"] == 2  # LLAMA_ARG_N_PARALLEL
        assert httpx.get(address + "/metrics").status_code == 200  # LLAMA_ARG_ENDPOINT_METRICS
        body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 500,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", address + "/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(line for line in lines if '"content":"' in line and '"content":""' not in line)
            process.send_signal(signal.SIGTERM)
            rest = list(lines)
        events = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "abort" and rest[-2] == "data: [DONE]"
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = (tmp_path / "server.log").read_text()
    assert "SIGTERM received" in text and "shutdown complete" in text
    steps = ("API key authentication: off", "chat template:", "Model loaded", "decode path:", "KV cache:",
             LISTENING_PREFIX)
    order = [text.index(s) for s in steps]
    assert order == sorted(order)  # A6: key, template, weights, decode path, engine, then the socket
