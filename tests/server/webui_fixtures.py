"""Servers started with --webui for the A5 tests: model-less, a models dir of tiny random llamas,
a fake hub on loopback for downloads, and small helpers to drive jobs."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxcel.config import EngineConfig
from mlxcel.serving.served_model import RuntimeOptions
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread
from mlxcel.server.model_control import ModelControl
from mlxcel.startup import ModelLoader
from mlxcel.server.state import ServerState
from tests.loading.fake_hub import FakeHub, FakeRepo, hub_serving
from tests.loading.tiny_checkpoint import tiny_llama_files, write_files

SESSION_KEY = "mlxcel-ui-test-session-key"
UI_ENGINE = EngineConfig(max_num_seqs=4, ctx_size=1024)


@dataclass
class WebUiServer:
    thread: ServerThread
    state: ServerState
    models_dir: Path

    @property
    def address(self) -> str:
        return self.thread.address

    @property
    def control(self) -> ModelControl:
        assert self.state.control is not None
        return self.state.control


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def tiny_chat_files(seed: int) -> dict[str, bytes]:
    """A tiny random llama with a plain chat template, so the chat routes serve it."""
    files = tiny_llama_files(seed)
    config = json.loads(files["tokenizer_config.json"])
    files["tokenizer_config.json"] = json.dumps({**config, "chat_template": CHAT_TEMPLATE}).encode()
    return files


def write_tiny_models(models_dir: Path, names: tuple[str, ...] = ("tiny-a", "tiny-b")) -> None:
    for seed, name in enumerate(names):
        write_files(models_dir / name, tiny_chat_files(seed))


@pytest.fixture
def start_webui(tmp_path: Path) -> Iterator[Callable[..., WebUiServer]]:
    """Start a model-less --webui server (session key SESSION_KEY unless api_keys are given)."""
    started: list[WebUiServer] = []

    def start(**fields: Any) -> WebUiServer:
        models_dir = tmp_path / "models"
        if not models_dir.exists():
            write_tiny_models(models_dir)
        fields.setdefault("ui_session_key", None if fields.get("api_keys") else SESSION_KEY)
        config = ServerConfig(port=0, webui=True, endpoint_metrics=True, **fields)
        state = ServerState(config)
        state.control = ModelControl(state, ModelLoader(RuntimeOptions(warmup=False), UI_ENGINE, models_dir))
        server = WebUiServer(ServerThread(state).start(), state, models_dir)
        started.append(server)
        return server

    yield start
    for server in started:
        server.thread.stop()
        server.control.stop(30)


@pytest.fixture
def ui_client(start_webui: Callable[..., WebUiServer]) -> Iterator[tuple[httpx.Client, WebUiServer]]:
    server = start_webui()
    with httpx.Client(base_url=server.address, timeout=120, headers={"Authorization": f"Bearer {SESSION_KEY}"}) as c:
        yield c, server


def wait_job(client: httpx.Client, job: dict[str, Any], timeout: float = 180.0) -> dict[str, Any]:
    """Poll a job until it is succeeded, failed or cancelled."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        job = client.get(f"/ui-api/v1/jobs/{job['id']}").json()["job"]
        if job["state"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job['id']} did not finish: {job}")


def run_job(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = client.post(f"/ui-api/v1{path}", json=body)
    assert reply.status_code == 202, reply.text
    return wait_job(client, reply.json()["job"])


def padded_repo(seed: int = 0, num_pads: int = 4, pad_bytes: int = 1 << 20) -> FakeRepo:
    """A tiny llama plus a few padding files, so a download reports progress in several steps."""
    files = tiny_chat_files(seed)
    files |= {f"extra/pad-{i}.bin": bytes([i]) * pad_bytes for i in range(num_pads)}
    return FakeRepo(files)


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A hub on 127.0.0.1 with `acme/tiny-llama`; huggingface_hub in this process points at it."""
    with hub_serving({"acme/tiny-llama": padded_repo()}, monkeypatch) as hub:
        yield hub
