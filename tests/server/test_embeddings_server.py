"""Embeddings and rerank beside the chat model, through the real server (spec I, F1, F3, F4).

One server over the session SmolLM2 engine with the real all-MiniLM-L6-v2 embedding provider
and a tiny random 1-label BertForSequenceClassification reranker, both loaded by the same
`plan_process` / `load_side_models` path the CLI takes. Embeddings are compared with
sentence-transformers' own output; rerank scores with transformers' classifier.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from mlxcel.loading import resolve_model
from mlxcel.serving.served_model import ServedModel
from mlxcel.server.lifecycle import ServerThread
from mlxcel.server.state import ServerState
from mlxcel.serving.side_models import SideModels, load_side_models, plan_process, side_model_options
from tests.server.conftest import SERVER, chat_body
from tests.workers.test_rerank_provider import transformers_scores
from tests.workers.tiny_checkpoints import minilm_dir, write_tiny_bert  # noqa: F401 - minilm_dir is a fixture

pytestmark = pytest.mark.slow

LONG = " ".join(["The giant panda lives in the bamboo forests of central China and eats bamboo."] * 14)
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé façade — naïve café, 日本語のテキスト, emoji 🙂🚀, Ελληνικά, русский текст",
    "x",
    "A man is playing a guitar on the stage while people dance.",
    LONG,  # about 230 tokens: inside the model's 256-token window
]
QUERY = "What is a panda?"
DOCUMENTS = ["hi", "it is a bear", "The giant panda is a bear species endemic to China.",
             "Pandas is a Python library for data frames.", "bamboo"]


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bert(tmp_path_factory.mktemp("cross"), classifier=True)


@pytest.fixture(scope="module")
def side(minilm_dir: Path, cross_encoder_dir: Path) -> Iterator[SideModels]:  # noqa: F811
    # The packaged name, as a user types it: resolved to the unpacked minilm_dir.
    options = side_model_options(embedding_model="all-minilm-l6-v2", reranker_model=str(cross_encoder_dir),
                                 rerank_batch_size_flag=2)
    plan = plan_process(None, options, resolve_model)
    assert plan.chat is not None and plan.mode is None  # the default chat model stays served
    side = load_side_models(plan, options, int(time.time()))
    yield side
    assert side.stop(30)


@pytest.fixture(scope="module")
def address(served: ServedModel, side: SideModels) -> Iterator[str]:
    thread = ServerThread(ServerState(SERVER, served, side=side)).start()
    yield thread.address
    thread.stop()


@pytest.fixture(scope="module")
def reference(minilm_dir: Path) -> np.ndarray:  # noqa: F811
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir), device="cpu", local_files_only=True)
    return model.encode(SENTENCES, convert_to_numpy=True)


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))


def test_f1_openai_sdk_float_and_base64_match_sentence_transformers(address: str, reference: np.ndarray) -> None:
    client = openai.OpenAI(base_url=address + "/v1", api_key="unused", max_retries=0)
    as_float = client.embeddings.create(model="all-minilm-l6-v2", input=SENTENCES, encoding_format="float")
    as_base64 = client.embeddings.create(model="all-minilm-l6-v2", input=SENTENCES, encoding_format="base64")
    by_default = client.embeddings.create(model="all-minilm-l6-v2", input=SENTENCES)  # the SDK asks for base64
    floats = np.array([item.embedding for item in as_float.data], dtype=np.float32)
    decoded = np.array([np.frombuffer(base64.b64decode(item.embedding), dtype="<f4") for item in as_base64.data])
    assert floats.shape == reference.shape == (len(SENTENCES), 384)
    assert cosines(floats, reference).min() >= 0.9999
    assert np.array_equal(decoded, floats)
    assert np.array_equal(np.array([item.embedding for item in by_default.data], dtype=np.float32), floats)
    assert [item.index for item in as_float.data] == list(range(len(SENTENCES)))
    assert as_float.model == "all-minilm-l6-v2" and as_float.usage.prompt_tokens > 230


def test_f1_longer_than_the_window_is_400_unless_truncate(address: str, minilm_dir: Path) -> None:  # noqa: F811
    from sentence_transformers import SentenceTransformer

    too_long = LONG + " " + LONG
    response = httpx.post(address + "/v1/embeddings", json={"input": too_long})
    assert response.status_code == 400 and "window of 256 tokens" in response.json()["error"]["message"]
    response = httpx.post(address + "/v1/embeddings", json={"input": [too_long], "truncate": True})
    got = np.array([response.json()["data"][0]["embedding"]], dtype=np.float32)
    want = SentenceTransformer(str(minilm_dir), device="cpu", local_files_only=True).encode([too_long])
    assert cosines(got, want)[0] >= 0.9999  # sentence-transformers truncates at the same 256 tokens


def test_f1_bad_fields_are_400(address: str) -> None:
    for body in ({"input": []}, {"input": "x", "dimensions": 100}, {"input": "x", "encoding_format": "hex"},
                 {"model": "m"}):
        response = httpx.post(address + "/v1/embeddings", json=body)
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error", body
    assert httpx.post(address + "/v1/embeddings", content=b"{", headers={"content-type": "application/json"}
                      ).status_code == 400


def test_f1_token_id_inputs(address: str) -> None:
    ids = [101, 7592, 2088, 102]  # [CLS] hello world [SEP]
    by_ids = httpx.post(address + "/v1/embeddings", json={"input": [ids]}).json()
    by_text = httpx.post(address + "/v1/embeddings", json={"input": "hello world"}).json()
    assert by_ids["usage"]["prompt_tokens"] == 4 == by_text["usage"]["prompt_tokens"]
    assert np.allclose(by_ids["data"][0]["embedding"], by_text["data"][0]["embedding"], atol=1e-6)


@pytest.mark.parametrize("path", ["/embedding", "/embeddings"])
def test_f4_native_routes_answer_in_llama_server_shape(address: str, path: str, reference: np.ndarray) -> None:
    body = httpx.post(address + path, json={"content": SENTENCES[:2]}).json()
    assert isinstance(body, list) and [entry["index"] for entry in body] == [0, 1]
    vectors = np.array([entry["embedding"][0] for entry in body], dtype=np.float32)  # one pooled row each
    assert cosines(vectors, reference[:2]).min() >= 0.9999
    mixed = httpx.post(address + path, json={"input": ["hello world", [101, 7592, 2088, 102]]}).json()
    assert np.allclose(mixed[0]["embedding"][0], mixed[1]["embedding"][0], atol=1e-6)


@pytest.mark.parametrize("path", ["/v1/rerank", "/v1/reranking", "/rerank", "/reranking"])
def test_f3_rerank_order_matches_the_classifier_scores(address: str, cross_encoder_dir: Path, path: str) -> None:
    want = transformers_scores(cross_encoder_dir, QUERY, DOCUMENTS)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    body = httpx.post(address + path, json={"query": QUERY, "documents": DOCUMENTS, "top_n": 3,
                                            "return_documents": True}).json()
    assert [r["index"] for r in body["results"]] == order[:3]
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(1 / (1 + np.exp(-want[result["index"]])), abs=1e-4)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    tei = httpx.post(address + path, json={"query": QUERY, "texts": DOCUMENTS, "raw_scores": True}).json()
    assert [r["index"] for r in tei] == order
    assert [r["score"] for r in tei] == pytest.approx([want[i] for i in order], abs=1e-4)


def test_f3_rerank_bad_bodies_are_400(address: str) -> None:
    for body in ({"query": "q"}, {"query": "", "documents": ["a"]}, {"query": "q", "documents": [3]},
                 {"query": "q", "documents": ["a"], "texts": ["a"]}):
        response = httpx.post(address + "/v1/rerank", json=body)
        assert response.status_code == 400, body


def test_i_models_health_and_metrics_report_the_providers(address: str, side: SideModels) -> None:
    cards = {card["id"]: card["capabilities"] for card in httpx.get(address + "/v1/models").json()["data"]}
    assert cards[side.embedding_info.name] == ["embedding"]  # type: ignore[union-attr]
    assert cards[side.reranker_info.name] == ["rerank"]  # type: ignore[union-attr]
    assert ["completion"] in cards.values()
    one = httpx.get(address + f"/v1/models/{side.embedding_info.name}").json()  # type: ignore[union-attr]
    assert one["capabilities"] == ["embedding"] and one["max_model_len"] == 256
    health = httpx.get(address + "/health").json()
    assert health["status"] == "ok"
    assert {p["capability"]: p["max_queue_depth"] for p in health["providers"]} == {"embedding": 8, "rerank": 8}
    before = side.stats()[0].num_completed
    httpx.post(address + "/v1/embeddings", json={"input": "count me"})
    metrics = httpx.get(address + "/metrics").text
    assert f'mlxcel_worker_completed_total{{worker="embedding"}} {before + 1}.0' in metrics
    assert 'mlxcel_worker_queue_depth{worker="rerank"} 0.0' in metrics


def test_i_chat_is_served_beside_the_providers(address: str) -> None:
    response = httpx.post(address + "/v1/chat/completions", json=chat_body(), timeout=60)
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]
