"""A3: a family that cannot batch (its module sets SUPPORTS_BATCHING = False) is served with one
slot whatever --parallel says: the clamp is logged, and /props, /slots and /v1/settings show 1."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

import mlxcel.models.llama as llama_family
from mlxcel.config import EngineConfig
from mlxcel.loading import resolve_model
from mlxcel.serving.chat_model import start_served_model
from mlxcel.serving.served_model import RuntimeOptions
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread
from mlxcel.server.state import ServerState
from tests.loading.tiny_checkpoint import tiny_llama_files, write_files


def test_a3_family_that_cannot_batch_gets_one_slot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    folder = write_files(tmp_path / "tiny", tiny_llama_files())
    monkeypatch.setattr(llama_family, "SUPPORTS_BATCHING", False, raising=False)  # the family flag
    with caplog.at_level(logging.WARNING, logger="mlxcel.serving.served_model"):
        served = start_served_model(resolve_model(str(folder)), RuntimeOptions(warmup=False),
                                    EngineConfig(max_num_seqs=4, ctx_size=512))
    try:
        assert "llama cannot batch requests: --parallel 4 clamped to 1" in caplog.text
        assert served.engine_config.max_num_seqs == 1 and served.engine.core.config.max_num_seqs == 1
        thread = ServerThread(ServerState(ServerConfig(port=0, endpoint_props=True), served)).start()
        try:
            with httpx.Client(base_url=thread.address, timeout=60) as http:
                assert http.get("/props").json()["total_slots"] == 1
                assert len(http.get("/slots").json()) == 1
                assert http.get("/v1/settings").json()["settings"]["parallel"] == 1
                reply = http.post("/v1/completions", json={"model": "m", "prompt": "ab", "max_tokens": 3})
                assert reply.status_code == 200
        finally:
            thread.stop()
    finally:
        served.close(30)


def test_a3_families_batch_by_default(tmp_path: Path) -> None:
    folder = write_files(tmp_path / "tiny", tiny_llama_files())
    served = start_served_model(resolve_model(str(folder)), RuntimeOptions(warmup=False),
                                EngineConfig(max_num_seqs=3, ctx_size=512))
    try:
        assert served.engine_config.max_num_seqs == 3
    finally:
        served.close(30)
