"""Embedding and rerank adapters (F1 /v1/embeddings, F4 /embedding, F3 rerank): request
parsing with 400-ready errors, golden response JSON, base64 round trip, and the whole
route body run against real providers on tiny checkpoints."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from mlxcel.api import rerank as rerank_api
from mlxcel.api.embedding_input import parse_inputs
from mlxcel.api.errors import ApiError
from mlxcel.api.llama_server import embeddings as native
from mlxcel.api.openai import embeddings as openai_api
from mlxcel.workers.embedding import (
    EmbeddingConfig,
    EmbeddingModel,
    EmbeddingOptions,
    EmbeddingProvider,
    EmbeddingResult,
    PoolingType,
)
from mlxcel.workers.encoder_inputs import InputTooLongError
from mlxcel.workers.rerank import RerankProvider, RerankResult
from tests.workers.tiny_checkpoints import write_sentence_transformers_files, write_tiny_bert

VECTORS = [np.array([0.5, -0.25, 0.125], dtype=np.float32), np.array([1.0, 0.0, -1.5], dtype=np.float32)]
RESULT = EmbeddingResult(VECTORS, [4, 6], is_per_token=False)


@pytest.fixture(scope="module")
def embedding_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_tiny_bert(tmp_path_factory.mktemp("emb"))
    write_sentence_transformers_files(folder, {"pooling_mode_mean_tokens": True}, max_seq_length=16)
    return folder


@pytest.fixture(scope="module")
def embedder(embedding_dir: Path) -> Iterator[EmbeddingProvider]:
    provider = EmbeddingProvider.load(embedding_dir)
    yield provider
    provider.stop(5)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RerankProvider]:
    provider = RerankProvider.load(write_tiny_bert(tmp_path_factory.mktemp("cross"), classifier=True))
    yield provider
    provider.stop(5)


# --- input forms -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([101, 7592, 102], [[101, 7592, 102]]),
        ([[101, 102], [101, 7592, 102]], [[101, 102], [101, 7592, 102]]),
    ],
)
def test_F1_input_forms(value: object, expected: list) -> None:
    assert parse_inputs(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], "must be a string, a list of strings"),
        (None, "must be a string, a list of strings"),
        (["a", [101]], "must not mix"),
        ([True, False], r"input\[0\]"),
        ([[101], []], r"input\[1\]"),
        ([1.5], r"input\[0\]"),
    ],
)
def test_F1_bad_inputs_are_400s(value: object, message: str) -> None:
    with pytest.raises(ApiError, match=message):
        parse_inputs(value)


def test_F4_native_accepts_mixed_inputs_and_content() -> None:
    request = native.parse_native_embedding_request({"content": ["a", [101, 102]], "embd_normalize": -1})
    assert request.inputs == ["a", [101, 102]] and request.options.normalize == -1
    with pytest.raises(ApiError, match='"input" or "content" must be provided'):
        native.parse_native_embedding_request({"prompt": "x"})


# --- OpenAI /v1/embeddings ---------------------------------------------------------------


def test_F1_openai_golden_float_response() -> None:
    request = openai_api.parse_embeddings_request({"input": ["a", "b"], "model": "m"})
    assert openai_api.build_embeddings_response(request, RESULT, "all-minilm-l6-v2") == {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": [0.5, -0.25, 0.125]},
            {"object": "embedding", "index": 1, "embedding": [1.0, 0.0, -1.5]},
        ],
        "model": "all-minilm-l6-v2",
        "usage": {"prompt_tokens": 10, "total_tokens": 10},
    }


def test_F1_base64_is_little_endian_float32_as_the_openai_sdk_decodes() -> None:
    from openai.types import CreateEmbeddingResponse

    request = openai_api.parse_embeddings_request({"input": "a", "encoding_format": "base64"})
    body = openai_api.build_embeddings_response(request, RESULT, "m")
    assert body["data"][0]["embedding"] == base64.b64encode(b"\x00\x00\x00?\x00\x00\x80\xbe\x00\x00\x00>").decode()
    for entry, vector in zip(body["data"], VECTORS):
        decoded = np.frombuffer(base64.b64decode(entry["embedding"]), dtype="float32")  # as the SDK does
        np.testing.assert_array_equal(decoded, vector)
        entry["embedding"] = decoded.tolist()
    CreateEmbeddingResponse.model_validate(body)  # the SDK's own schema accepts the decoded body


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "'input' is required"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "dimensions": 0}, "'dimensions' must be a positive integer"),
        ({"input": "a", "truncate": "yes"}, "'truncate' must be true or false"),
        ({"input": "a", "model": 3}, "'model' must be a string"),
        ([1, 2], "JSON object"),
    ],
)
def test_F1_bad_request_fields_are_400s(body: object, message: str) -> None:
    with pytest.raises(ApiError, match=message):
        openai_api.parse_embeddings_request(body)


def test_F1_route_body_float_and_base64_agree(embedder: EmbeddingProvider) -> None:
    inputs = ["A man is eating food.", "Ünïcödé 日本語 🙂"]
    as_float = asyncio.run(openai_api.create_embeddings(embedder, {"input": inputs}, "tiny"))
    as_b64 = asyncio.run(
        openai_api.create_embeddings(embedder, {"input": inputs, "encoding_format": "base64"}, "tiny")
    )
    direct = embedder.embed_sync(inputs)
    for index, vector in enumerate(direct.embeddings):
        np.testing.assert_allclose(as_float["data"][index]["embedding"], vector, atol=1e-6)
        decoded = np.frombuffer(base64.b64decode(as_b64["data"][index]["embedding"]), dtype="<f4")
        np.testing.assert_allclose(decoded, as_float["data"][index]["embedding"], atol=1e-7)
    assert as_float["usage"]["prompt_tokens"] == direct.total_prompt_tokens


def test_F1_route_body_errors(embedder: EmbeddingProvider) -> None:
    with pytest.raises(InputTooLongError, match="input 0 has 42 tokens, more than the model's window of 16"):
        asyncio.run(openai_api.create_embeddings(embedder, {"input": "word " * 40}, "tiny"))
    body = asyncio.run(openai_api.create_embeddings(embedder, {"input": "word " * 40, "truncate": True}, "tiny"))
    assert body["usage"]["prompt_tokens"] == 16
    with pytest.raises(ValueError, match="does not support 'dimensions'"):
        asyncio.run(openai_api.create_embeddings(embedder, {"input": "x", "dimensions": 8}, "tiny"))


def test_F1_pooling_none_is_refused_by_the_openai_route(embedding_dir: Path) -> None:
    provider = EmbeddingProvider(EmbeddingModel(embedding_dir, EmbeddingConfig(pooling=PoolingType.NONE)))
    with pytest.raises(ApiError, match="pooling 'none'.*/embedding"):
        asyncio.run(openai_api.create_embeddings(provider, {"input": "x"}, "tiny"))


# --- llama-server /embedding -------------------------------------------------------------


def test_F4_native_golden_pooled_response() -> None:
    assert native.build_native_embedding_response(RESULT) == [
        {"index": 0, "embedding": [[0.5, -0.25, 0.125]]},
        {"index": 1, "embedding": [[1.0, 0.0, -1.5]]},
    ]


def test_F4_native_pooling_none_returns_raw_rows_per_token(embedding_dir: Path) -> None:
    model = EmbeddingModel(embedding_dir, EmbeddingConfig(pooling=PoolingType.NONE))
    provider = EmbeddingProvider(model)
    provider.start()
    try:
        body = asyncio.run(native.create_native_embedding(provider, {"input": ["hello world", [101, 102]]}))
    finally:
        provider.stop(5)
    assert [entry["index"] for entry in body] == [0, 1]
    assert [len(entry["embedding"]) for entry in body] == [4, 2]  # [CLS] hello world [SEP]; 2 ids
    assert all(len(row) == 32 for entry in body for row in entry["embedding"])
    assert np.linalg.norm(body[0]["embedding"][0]) > 1.5  # raw, not normalized


def test_F4_native_route_normalizes_per_request(embedder: EmbeddingProvider) -> None:
    body = asyncio.run(native.create_native_embedding(embedder, {"content": "hello", "embd_normalize": 1}))
    [[vector]] = [entry["embedding"] for entry in body]
    assert np.abs(vector).sum() == pytest.approx(1.0, abs=1e-5)  # taxicab
    default = embedder.embed_sync(["hello"], EmbeddingOptions()).embeddings[0]
    assert np.linalg.norm(default) == pytest.approx(1.0, abs=1e-5)  # the checkpoint's Normalize


# --- rerank ------------------------------------------------------------------------------

SCORES = RerankResult([0.5, -2.0, 3.0, 0.5], num_prompt_tokens=40)
DOCS = ["a", "b", "c", "d"]


def test_F3_jina_cohere_golden_response() -> None:
    request = rerank_api.parse_rerank_request(
        {"query": "q", "documents": ["a", {"text": "b"}, "c", "d"], "top_n": 3, "return_documents": True}
    )
    body = rerank_api.build_rerank_response(request, SCORES, "tiny-reranker")
    assert body == {
        "model": "tiny-reranker",
        "object": "list",
        "usage": {"prompt_tokens": 40, "total_tokens": 40},
        "results": [
            {"index": 2, "relevance_score": pytest.approx(0.9525741268), "document": {"text": "c"}},
            {"index": 0, "relevance_score": pytest.approx(0.6224593312), "document": {"text": "a"}},
            {"index": 3, "relevance_score": pytest.approx(0.6224593312), "document": {"text": "d"}},
        ],
    }


def test_F3_tei_golden_response() -> None:
    request = rerank_api.parse_rerank_request({"query": "q", "texts": DOCS, "raw_scores": True, "return_text": True})
    assert rerank_api.build_rerank_response(request, SCORES, "m") == [
        {"index": 2, "score": 3.0, "text": "c"},
        {"index": 0, "score": 0.5, "text": "a"},
        {"index": 3, "score": 0.5, "text": "d"},
        {"index": 1, "score": -2.0, "text": "b"},
    ]
    squashed = rerank_api.parse_rerank_request({"query": "q", "texts": DOCS})
    body = rerank_api.build_rerank_response(squashed, SCORES, "m")
    assert [entry["score"] for entry in body] == pytest.approx([0.9525741, 0.6224593, 0.6224593, 0.1192029])
    assert "text" not in body[0]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"documents": ["a"]}, "'query' must be a non-empty string"),
        ({"query": "q"}, "'documents' must be a non-empty list"),
        ({"query": "q", "documents": []}, "'documents' must be a non-empty list"),
        ({"query": "q", "documents": [{"title": "x"}]}, r"'documents\[0\]' must be a string or an object"),
        ({"query": "q", "documents": ["a"], "texts": ["a"]}, "not both"),
        ({"query": "q", "documents": ["a"], "top_n": 0}, "'top_n' must be a positive integer"),
        ({"query": "q", "texts": "a"}, "'texts' must be a non-empty list"),
    ],
)
def test_F3_bad_rerank_requests_are_400s(body: dict, message: str) -> None:
    with pytest.raises(ApiError, match=message):
        rerank_api.parse_rerank_request(body)


def test_F3_sigmoid_is_stable_at_the_extremes() -> None:
    assert rerank_api.sigmoid(-1000.0) == 0.0 and rerank_api.sigmoid(1000.0) == 1.0


def test_F3_route_body_orders_by_the_cross_encoder(reranker: RerankProvider) -> None:
    docs = ["hi", "it is a bear", "The giant panda is a bear species endemic to China.", "bamboo"]
    raw = reranker.rerank_sync("What is a panda?", docs).scores
    body = asyncio.run(rerank_api.rerank(reranker, {"query": "What is a panda?", "documents": docs}, "tiny"))
    assert [entry["index"] for entry in body["results"]] == sorted(range(len(docs)), key=lambda i: -raw[i])
    scores = [entry["relevance_score"] for entry in body["results"]]
    assert scores == sorted(scores, reverse=True) and all(0.0 < s < 1.0 for s in scores)
    assert body["usage"]["prompt_tokens"] > 0
