"""Real servers on 127.0.0.1 port 0 over the real default model (SmolLM2-135M), loaded once per session."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import torch

from mlxcel.config import EngineConfig
from mlxcel.engine.client import EngineClient
from mlxcel.engine.loop import EngineCore
from mlxcel.chat.plan import FeatureSettings
from mlxcel.serving.served_model import ServedModel, build_chat_features, model_shape
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread
from mlxcel.server.state import ServerState

ENGINE = EngineConfig(max_num_seqs=4, ctx_size=4096, decode_step="native")  # 1024 tokens per slot; the CPU default step
SERVER = ServerConfig(port=0, endpoint_metrics=True, endpoint_props=True)


@pytest.fixture(scope="session")
def served() -> Iterator[ServedModel]:
    from mlxcel.loading import resolve_model
    from mlxcel.serving.chat_model import start_served_model
    from mlxcel.serving.served_model import RuntimeOptions

    torch.set_num_threads(1)
    model = start_served_model(resolve_model(None), RuntimeOptions(warmup=False), ENGINE)
    yield model
    model.close(30)


def engine_like(base: ServedModel, config: EngineConfig, cache_identity: str = "") -> ServedModel:
    """Another engine (own KV pool and scheduler) over the same loaded weights: no second load. A
    `cache_identity` lets a disk tier open (`prefix_cache_dir`), as the served model's KV identity does."""
    core = EngineCore(base.loaded.model, model_shape(base.loaded), config, eos_token_ids=base.tokenizer.eos_token_ids,
                      cache_identity=cache_identity)
    core.start()
    features = build_chat_features(base.name, base.loaded, base.tokenizer, base.chat_template, FeatureSettings())
    return ServedModel(base.name, base.loaded, base.tokenizer, base.chat_template, EngineClient(core), config, features)


@pytest.fixture(scope="session")
def start_server() -> Iterator[Callable[..., ServerThread]]:
    """Start a ServerThread for a model and a config; all are stopped at the end of the session."""
    threads: list[ServerThread] = []

    def start(model: ServedModel | None, config: ServerConfig = SERVER) -> ServerThread:
        thread = ServerThread(ServerState(config, model)).start()
        threads.append(thread)
        return thread

    yield start
    for thread in threads:
        thread.stop()


@pytest.fixture(scope="session")
def server(served: ServedModel, start_server: Callable[..., ServerThread]) -> ServerThread:
    return start_server(served)


@pytest.fixture()
def client(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.address, timeout=120) as http:
        yield http


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def chat_body(content: str = "Hi", **fields: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 6,
            **fields}


__all__ = ["ENGINE", "SERVER", "chat_body", "engine_like", "wait_until"]
