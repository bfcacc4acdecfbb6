"""One real server per test module over SmolLM2 (port 0, loopback), sized for bounded CI time.

Small context and few slots keep any generation a hostile body might still start short; the
slot folder is a temporary directory so slot file names can be attacked for real.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from mlxcel.config import EngineConfig
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread
from mlxcel.server.state import ServerState

RELIABILITY_ENGINE = dict(max_num_seqs=2, ctx_size=512, max_queue_depth=8)  # 256 tokens per slot


@dataclass
class LiveServer:
    """A running server and what a reliability test reads of it."""

    address: str
    thread: ServerThread
    state: ServerState

    def rss_bytes(self) -> int:
        """This process's resident memory (the server runs in it)."""
        text = Path("/proc/self/status").read_text()
        match = re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE)
        return int(match.group(1)) * 1024 if match else 0

    def is_healthy(self) -> bool:
        response = httpx.get(self.address + "/health", timeout=30)
        return response.status_code == 200 and response.json()["status"] == "ok"


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from mlxcel.loading import resolve_model
    from mlxcel.serving.chat_model import start_served_model
    from mlxcel.serving.served_model import RuntimeOptions

    torch.set_num_threads(1)
    slots = tmp_path_factory.mktemp("slots")
    served = start_served_model(resolve_model(None), RuntimeOptions(warmup=False),
                                EngineConfig(**RELIABILITY_ENGINE, slot_save_path=str(slots)))
    state = ServerState(ServerConfig(port=0, endpoint_metrics=True, endpoint_props=True), served)
    thread = ServerThread(state).start()
    try:
        yield LiveServer(thread.address, thread, state)
    finally:
        thread.stop()
        served.close(30)
