"""Single-purpose `mlxcel-server` processes (spec I, A7): `-m` an embedding checkpoint, the
`--embeddings` restricted mode, and a generative reranker chosen by giving -m's path to
`--reranker-model` (loaded once). Chat, completions and the like answer 501 naming the mode
and the flag; each process exits 0 on SIGTERM after joining its workers.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

from mlxcel.loading import load_model, resolve_model
from mlxcel.serving.served_model import load_tokenizer
from mlxcel.workers.causal_lm import last_position_logits
from mlxcel.workers.rerank import RerankPrompt
from tests.server.test_process import read_address

pytestmark = pytest.mark.slow

SERVER = "import sys; from mlxcel.cli import server_main; sys.exit(server_main())"
MESSAGES = [{"role": "user", "content": "Hi"}]
CHAT_LIKE = {"/v1/chat/completions": {"messages": MESSAGES}, "/chat/completions": {"messages": MESSAGES},
             "/v1/completions": {"prompt": "Hi"}, "/completion": {"prompt": "Hi"}, "/tokenize": {"content": "Hi"},
             "/detokenize": {"tokens": [1]}, "/apply-template": {"messages": MESSAGES}, "/v1/responses": {"input": "Hi"}}


@contextmanager
def server_process(*args: str, env: dict[str, str] | None = None) -> Iterator[tuple[str, list[str]]]:
    """A real mlxcel-server on port 0; yields (address, log lines) and checks a clean SIGTERM exit."""
    command = [sys.executable, "-c", SERVER, "--port", "0", "--no-warmup", *args]
    process = subprocess.Popen(command, env={**os.environ, **(env or {})}, stderr=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, text=True)
    log: list[str] = []
    try:
        yield read_address(process, log), log
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, "".join(log)  # A7: every worker joined in time
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def assert_chat_routes_501(address: str, mode: str, flag: str) -> None:
    for path, body in CHAT_LIKE.items():
        response = httpx.post(address + path, json=body)
        assert response.status_code == 501, (path, response.text)
        error = response.json()["error"]
        assert (error["type"], error["code"], error["mode"], error["flag"]) == ("not_supported_error", 501, mode, flag)
        assert mode in error["message"] and "-m CHAT_MODEL" in error["message"]
    anthropic = httpx.post(address + "/v1/messages", json={"model": "m", "max_tokens": 4, "messages": MESSAGES})
    assert anthropic.status_code == 501 and mode in anthropic.json()["error"]["message"]


def test_i_embedding_checkpoint_as_m_starts_an_embedding_only_process() -> None:
    with server_process("-m", "all-minilm-l6-v2") as (address, _):
        assert_chat_routes_501(address, "embedding-only", "--embedding-model")
        embedded = httpx.post(address + "/v1/embeddings", json={"input": ["a", "b"]}).json()
        assert len(embedded["data"]) == 2 and len(embedded["data"][0]["embedding"]) == 384
        assert embedded["model"] == "all-minilm-l6-v2"
        models = httpx.get(address + "/v1/models").json()["data"]
        assert [(m["id"], m["capabilities"]) for m in models] == [("all-minilm-l6-v2", ["embedding"])]
        health = httpx.get(address + "/health")
        assert health.status_code == 200 and health.json()["model"] == "all-minilm-l6-v2"
        rerank = httpx.post(address + "/v1/rerank", json={"query": "q", "documents": ["d"]})
        assert rerank.status_code == 501 and "--reranker-model" in rerank.json()["error"]["message"]
        images = httpx.post(address + "/v1/images/generations", json={"prompt": "x"})  # spec J: mounted only
        assert images.status_code == 404  # with --image-model, so no 501 for it anywhere


def test_i_embeddings_restricted_mode_from_its_env_mirror_loads_no_chat_model() -> None:
    env = {"LLAMA_ARG_EMBEDDINGS": "1", "LLAMA_ARG_EMBEDDING_MODEL": "all-minilm-l6-v2"}
    with server_process(env=env) as (address, log):
        assert_chat_routes_501(address, "embedding-only", "--embeddings")
        assert httpx.post(address + "/embedding", json={"content": "hi"}).status_code == 200
        assert not any("Model loaded" in line for line in log)  # the default chat model was never loaded


def test_i_contradicting_flags_refuse_startup_naming_them() -> None:
    command = [sys.executable, "-c", SERVER, "--port", "0", "--embeddings"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "--embeddings" in result.stderr and "--embedding-model" in result.stderr


def direct_scores(path: Path, query: str, documents: list[str]) -> list[float]:
    """logit(yes) - logit(no), one prompt at a time, from a float32 copy of the model."""
    loaded = load_model(path, dtype=torch.float32)
    tokenizer = load_tokenizer(loaded)
    prompt = RerankPrompt()
    yes, no = (tokenizer.encode(word, add_special_tokens=False)[0] for word in ("yes", "no"))
    scores = []
    for document in documents:
        ids = [tokenizer.encode(part, add_special_tokens=False)
               for part in (prompt.prefix, prompt.body(query, document), prompt.suffix)]
        logits = last_position_logits(loaded.model, [ids[0] + ids[1] + ids[2]], "cpu")[0]
        scores.append(float(logits[yes] - logits[no]))
    return scores


def test_i_generative_reranker_with_the_same_path_as_m() -> None:
    path = str(resolve_model(None).path)  # the default SmolLM2, chosen explicitly
    query = "What is the capital of France?"
    documents = ["Paris is the capital of France.", "Bananas are yellow.", "Berlin is in Germany."]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the reference loads while the server starts
        reference = pool.submit(direct_scores, Path(path), query, documents)
        with server_process("-m", path, "--reranker-model", path, "--rerank-batch-size", "2") as (address, log):
            check_generative_server(address, log, query, documents, reference.result())


def check_generative_server(address: str, log: list[str], query: str, documents: list[str],
                            want: list[float]) -> None:
    assert_chat_routes_501(address, "rerank-only", "--reranker-model")
    tei = httpx.post(address + "/rerank", json={"query": query, "texts": documents, "raw_scores": True},
                     timeout=60).json()
    order = sorted(range(len(documents)), key=lambda i: -want[i])
    assert [r["index"] for r in tei] == order
    assert [r["score"] for r in tei] == pytest.approx([want[i] for i in order], abs=1e-3)
    models = httpx.get(address + "/v1/models").json()["data"]
    assert [m["capabilities"] for m in models] == [["rerank"]]
    # -m and --reranker-model: one load ("mapped (no tensor read yet) llama weights ..." or "read llama weights ...")
    assert sum(" llama weights (" in line for line in log) == 1
