"""Embedding provider (spec I): pooling and normalization read from the checkpoint and
overridable, llama-server's --embd-normalize math, window errors and truncation,
`dimensions`, and equality with sentence-transformers on the real all-MiniLM-L6-v2."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from mlxcel.loading.errors import ModelLoadError
from mlxcel.loading.encoder import is_embedding_checkpoint
from mlxcel.workers.embedding import (
    EmbeddingConfig,
    EmbeddingModel,
    EmbeddingOptions,
    EmbeddingProvider,
    PoolingType,
    normalize_embedding,
    read_checkpoint_pooling,
)
from mlxcel.workers.encoder_inputs import InputError, InputTooLongError
from tests.workers.tiny_checkpoints import (  # noqa: F401 - minilm_dir is a fixture
    minilm_dir,
    write_sentence_transformers_files,
    write_tiny_bert,
)

SENTENCES = ["A man is eating food.", "The weather is lovely today", "embeddings!"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_tiny_bert(tmp_path_factory.mktemp("tiny"))
    write_sentence_transformers_files(folder, {"pooling_mode_mean_tokens": True}, max_seq_length=16)
    return folder


@pytest.fixture
def provider(tiny_dir: Path) -> Iterator[EmbeddingProvider]:
    provider = EmbeddingProvider.load(tiny_dir)
    yield provider
    assert provider.stop(5)


@functools.cache
def reference_model(folder: Path) -> torch.nn.Module:
    from transformers import BertModel

    return BertModel.from_pretrained(str(folder)).eval()


def hidden_states(folder: Path, text: str) -> torch.Tensor:
    """[num_tokens, dim] straight from transformers, for reference pooling."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
    ids = [i for i in ids if i != 0]  # the stored tokenizer pads to 128
    with torch.no_grad():
        return reference_model(folder)(torch.tensor([ids])).last_hidden_state[0]


@pytest.mark.parametrize(
    ("pooling_config", "expected"),
    [
        ({"pooling_mode_mean_tokens": True}, PoolingType.MEAN),
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, PoolingType.CLS),
        ({"pooling_mode_lasttoken": True}, PoolingType.LAST),
        ({}, PoolingType.MEAN),  # no mode set: sentence-transformers' default
        ({"pooling_mode": "cls"}, PoolingType.CLS),  # sentence-transformers >= 6
        ({"pooling_mode": ["lasttoken"]}, PoolingType.LAST),
    ],
)
def test_I_pooling_read_from_the_checkpoint(tmp_path: Path, pooling_config: dict, expected: PoolingType) -> None:
    write_sentence_transformers_files(tmp_path, pooling_config, normalize=False)
    declared = read_checkpoint_pooling(tmp_path)
    assert (declared.pooling, declared.normalize) == (expected, -1)


def test_I_normalize_module_and_plain_checkpoints_normalize(tmp_path: Path) -> None:
    assert read_checkpoint_pooling(tmp_path).normalize == 2  # no modules.json: llama-server's default
    write_sentence_transformers_files(tmp_path, {"pooling_mode_mean_tokens": True}, normalize=True)
    assert read_checkpoint_pooling(tmp_path).normalize == 2


def test_I_unsupported_pooling_needs_an_override(tmp_path: Path) -> None:
    folder = write_tiny_bert(tmp_path)
    write_sentence_transformers_files(folder, {"pooling_mode_max_tokens": True})
    with pytest.raises(ModelLoadError, match="'max'.*--pooling"):
        EmbeddingModel(folder)
    assert EmbeddingModel(folder, EmbeddingConfig(pooling=PoolingType.CLS)).pooling is PoolingType.CLS


def test_I_unknown_sentence_transformers_module_is_refused(tmp_path: Path) -> None:
    write_sentence_transformers_files(tmp_path, {"pooling_mode_mean_tokens": True})
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match="Dense"):
        read_checkpoint_pooling(tmp_path)


def test_I_embd_normalize_follows_llama_server() -> None:
    vector = np.array([3.0, -4.0, 1.0], dtype=np.float32)
    np.testing.assert_array_equal(normalize_embedding(vector, -1), vector)
    np.testing.assert_allclose(normalize_embedding(vector, 0), vector * 32760.0 / 4.0, rtol=1e-6)
    np.testing.assert_allclose(normalize_embedding(vector, 1), vector / 8.0, rtol=1e-6)
    np.testing.assert_allclose(normalize_embedding(vector, 2), vector / np.sqrt(26.0), rtol=1e-6)
    np.testing.assert_allclose(normalize_embedding(vector, 3), vector / np.cbrt(27.0 + 64.0 + 1.0), rtol=1e-6)
    assert not normalize_embedding(np.zeros(3, dtype=np.float32), 2).any()  # no division by zero


def test_I_mean_pooling_and_normalization_match_a_direct_computation(
    tiny_dir: Path, provider: EmbeddingProvider
) -> None:
    result = provider.embed_sync(SENTENCES)
    for text, vector in zip(SENTENCES, result.embeddings):
        mean = hidden_states(tiny_dir, text).mean(dim=0).numpy()
        np.testing.assert_allclose(vector, mean / np.linalg.norm(mean), atol=1e-5)
    assert result.num_prompt_tokens == [len(hidden_states(tiny_dir, t)) for t in SENTENCES]


@pytest.mark.parametrize("pooling", [PoolingType.CLS, PoolingType.LAST, PoolingType.NONE])
def test_I_pooling_override(tiny_dir: Path, pooling: PoolingType) -> None:
    model = EmbeddingModel(tiny_dir, EmbeddingConfig(pooling=pooling, normalize=-1))
    provider = EmbeddingProvider(model)
    provider.start()
    try:
        result = provider.embed_sync(SENTENCES[:2])  # different lengths: one row is padded
    finally:
        provider.stop(5)
    for text, got in zip(SENTENCES[:2], result.embeddings):
        hidden = hidden_states(tiny_dir, text).numpy()
        want = {PoolingType.CLS: hidden[0], PoolingType.LAST: hidden[-1], PoolingType.NONE: hidden}[pooling]
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert result.is_per_token is (pooling is PoolingType.NONE)


def test_I_too_long_input_names_the_lengths_unless_truncated(provider: EmbeddingProvider) -> None:
    long_text = "word " * 40  # 40 tokens + [CLS] [SEP] against a window of 16
    with pytest.raises(InputTooLongError, match="input 1 has 42 tokens, more than the model's window of 16"):
        provider.embed_sync(["short", long_text])
    result = provider.embed_sync(["short", long_text], EmbeddingOptions(truncate=True))
    assert result.num_prompt_tokens[1] == 16
    cut = provider.embed_sync(["word " * 14], EmbeddingOptions())  # exactly the window
    np.testing.assert_allclose(result.embeddings[1], cut.embeddings[0], atol=1e-6)


def test_I_token_id_inputs_are_used_as_given(provider: EmbeddingProvider) -> None:
    ids = provider.model.tokenizer.encode("A man is eating food.").ids
    ids = [i for i in ids if i != 0]
    by_ids = provider.embed_sync([ids, "A man is eating food."])
    np.testing.assert_allclose(by_ids.embeddings[0], by_ids.embeddings[1], atol=1e-6)
    with pytest.raises(InputError, match="outside the vocabulary"):
        provider.embed_sync([[101, 10**6]])
    with pytest.raises(InputError, match="empty string"):
        provider.embed_sync([""])


def test_I_dimensions_refused_without_matryoshka(provider: EmbeddingProvider) -> None:
    assert provider.embed_sync(["x"], EmbeddingOptions(dimensions=32)).embeddings[0].shape == (32,)
    with pytest.raises(InputError, match="does not support 'dimensions'"):
        provider.embed_sync(["x"], EmbeddingOptions(dimensions=8))


def test_I_dimensions_truncate_and_renormalize_on_a_matryoshka_model(tmp_path: Path) -> None:
    folder = write_tiny_bert(tmp_path, matryoshka_dimensions=[8, 16])
    provider = EmbeddingProvider.load(folder)
    try:
        full = provider.embed_sync(SENTENCES, EmbeddingOptions(normalize=-1)).embeddings
        short = provider.embed_sync(SENTENCES, EmbeddingOptions(dimensions=8)).embeddings
        with pytest.raises(InputError, match="one of 8, 16"):
            provider.embed_sync(SENTENCES, EmbeddingOptions(dimensions=12))
    finally:
        provider.stop(5)
    for whole, cut in zip(full, short):
        assert cut.shape == (8,)
        np.testing.assert_allclose(cut, whole[:8] / np.linalg.norm(whole[:8]), atol=1e-6)


def test_I_checkpoint_kind_detection(tiny_dir: Path, tmp_path: Path) -> None:
    assert is_embedding_checkpoint(tiny_dir)
    assert not is_embedding_checkpoint(write_tiny_bert(tmp_path, classifier=True))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.slow
def test_I_minilm_equals_sentence_transformers(minilm_dir: Path) -> None:
    from sentence_transformers import SentenceTransformer

    sentences = [
        "The quick brown fox jumps over the lazy dog.",
        "Ünïcödé façade — naïve café, 日本語のテキスト, emoji 🙂🚀, Ελληνικά, русский текст",
        "x",
        " ".join(f"token{i} and some filler words" for i in range(40)),  # ~240 tokens: inside 256
        "a very long input " * 200,  # far past the window: truncated like sentence-transformers
    ]
    reference = SentenceTransformer(str(minilm_dir), device="cpu", local_files_only=True)
    want = reference.encode(sentences, convert_to_numpy=True)
    provider = EmbeddingProvider.load(minilm_dir)
    try:
        got = provider.embed_sync(sentences, EmbeddingOptions(truncate=True))
        with pytest.raises(InputTooLongError, match="window of 256 tokens"):
            provider.embed_sync(sentences)  # the last one, without truncate
    finally:
        provider.stop(5)
    assert got.num_prompt_tokens[-1] == 256 and 200 < got.num_prompt_tokens[3] <= 256
    for ours, theirs in zip(got.embeddings, want):
        assert cosine(ours, theirs) >= 0.9999


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("dtype", "min_cosine"), [("float32", 0.99999), ("bfloat16", 0.99)])
def test_I_cuda_device_and_dtype_are_config(tiny_dir: Path, dtype: str, min_cosine: float) -> None:
    cpu = EmbeddingProvider.load(tiny_dir)
    cuda = EmbeddingProvider.load(tiny_dir, EmbeddingConfig(device="cuda", dtype=dtype))
    try:
        want = cpu.embed_sync(SENTENCES).embeddings
        got = cuda.embed_sync(SENTENCES).embeddings
    finally:
        cpu.stop(5)
        cuda.stop(5)
    assert all(vector.dtype == np.float32 for vector in got)
    assert min(cosine(a, b) for a, b in zip(got, want)) >= min_cosine
