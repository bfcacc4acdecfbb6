"""Rerank providers (spec I, F3): a tiny random 1-label BertForSequenceClassification
scores pairs as transformers does, through batches of --rerank-batch-size; the generative
reranker's prompt and yes/no math on a tiny causal LM built here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from mlxcel.loading.errors import ModelLoadError
from mlxcel.loading.encoder import is_rerank_checkpoint
from mlxcel.workers.base import WorkerConfig
from mlxcel.workers.encoder_inputs import InputError, InputTooLongError
from mlxcel.workers.rerank import (
    CrossEncoder,
    GenerativeReranker,
    RerankConfig,
    RerankPrompt,
    RerankProvider,
    answer_token_ids,
    rerank_batch_size,
)
from tests.workers.tiny_checkpoints import write_tiny_bert

QUERY = "What is a panda?"
DOCUMENTS = [
    "hi",
    "it is a bear",
    "The giant panda is a bear species endemic to China.",
    "Pandas is a Python library for data frames.",
    "bamboo",
]


@pytest.fixture(scope="module")
def cross_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bert(tmp_path_factory.mktemp("cross"), classifier=True)


@pytest.fixture
def provider(cross_dir: Path) -> Iterator[RerankProvider]:
    config = RerankConfig(worker=WorkerConfig(batch_size=rerank_batch_size(2)))
    provider = RerankProvider.load(cross_dir, config)
    yield provider
    assert provider.stop(5)


def transformers_scores(folder: Path, query: str, documents: list[str]) -> list[float]:
    """Each pair tokenized alone and scored by transformers' BertForSequenceClassification."""
    from tokenizers import Tokenizer
    from transformers import BertForSequenceClassification

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()
    model = BertForSequenceClassification.from_pretrained(str(folder)).eval()
    scores = []
    for doc in documents:
        pair = tokenizer.encode(query, doc)
        assert 1 in pair.type_ids  # the document is segment 1
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([pair.ids]), token_type_ids=torch.tensor([pair.type_ids])).logits
        scores.append(float(logits[0, 0]))
    return scores


def test_I_rerank_batch_size_zero_means_eight() -> None:
    assert (rerank_batch_size(0), rerank_batch_size(3)) == (8, 3)
    with pytest.raises(ValueError):
        rerank_batch_size(-1)


def test_I_cross_encoder_scores_and_order_match_transformers(cross_dir: Path, provider: RerankProvider) -> None:
    want = transformers_scores(cross_dir, QUERY, DOCUMENTS)
    result = provider.rerank_sync(QUERY, DOCUMENTS)  # 5 pairs in batches of 2, padded
    assert result.scores == pytest.approx(want, abs=1e-4)
    ranked = sorted(range(len(DOCUMENTS)), key=lambda i: -result.scores[i])
    assert ranked == sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    ordered = sorted(want)
    assert min(b - a for a, b in zip(ordered, ordered[1:])) > 1e-3  # the order is not noise
    assert result.num_prompt_tokens == sum(len(p.token_ids) for p in provider.encode(QUERY, DOCUMENTS, False))


def test_I_long_document_is_an_error_unless_truncated(provider: RerankProvider) -> None:
    long_doc = "bamboo forest " * 60  # the tiny model's window is 64 tokens
    with pytest.raises(InputTooLongError, match="document 1 has .* tokens, more than the model's window of 64"):
        provider.rerank_sync(QUERY, ["short", long_doc])
    pairs = provider.encode(QUERY, [long_doc], truncate=True)
    assert len(pairs[0].token_ids) == 64 and pairs[0].token_ids[-1] == 102  # [SEP] kept
    assert len(provider.rerank_sync(QUERY, [long_doc], truncate=True).scores) == 1
    with pytest.raises(InputTooLongError, match="the query has"):
        provider.rerank_sync("why " * 80, ["doc"], truncate=True)
    with pytest.raises(InputError, match="documents must not be empty"):
        provider.rerank_sync(QUERY, [])


def test_I_checkpoint_kinds(cross_dir: Path, tmp_path: Path) -> None:
    assert is_rerank_checkpoint(cross_dir)
    encoder = write_tiny_bert(tmp_path / "enc")
    assert not is_rerank_checkpoint(encoder)
    two_labels = write_tiny_bert(tmp_path / "two", classifier=True, num_labels=2)
    assert not is_rerank_checkpoint(two_labels)
    with pytest.raises(ModelLoadError, match="2 labels"):
        CrossEncoder(two_labels)


# --- generative reranker ------------------------------------------------------------------

YES, NO, VOCAB = 256, 257, 258


def encode(text: str) -> list[int]:
    """Bytes, except that the answers are single tokens, as in a real BPE vocabulary."""
    return {"yes": [YES], "no": [NO]}.get(text, list(text.encode("utf-8")))


class TinyCausalLM(nn.Module):
    """Each position sees the running mean of the embeddings so far: causal, pad-safe."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [batch, seq] -> [batch, seq, vocab]
        positions = torch.arange(1, ids.shape[1] + 1).view(1, -1, 1)
        running_mean = self.embed(ids).cumsum(dim=1) / positions
        return self.head(torch.tanh(self.mix(running_mean)) * 4.0)

    def last_logits(self, batch: list[list[int]]) -> torch.Tensor:
        """The LogitsFn hook: right-pad, run once, take each row's last real position."""
        lengths = torch.tensor([len(ids) for ids in batch])
        padded = torch.zeros((len(batch), int(lengths.max())), dtype=torch.long)
        for row, ids in enumerate(batch):
            padded[row, : len(ids)] = torch.tensor(ids)
        with torch.no_grad():
            return self(padded)[torch.arange(len(batch)), lengths - 1]


@pytest.fixture
def generative() -> Iterator[tuple[GenerativeReranker, TinyCausalLM, list[list[int]]]]:
    model = TinyCausalLM()
    calls: list[list[int]] = []

    def logits_fn(batch: list[list[int]]) -> torch.Tensor:
        calls.extend(batch)
        return model.last_logits(batch)

    reranker = GenerativeReranker(logits_fn, encode, window=1000, worker=WorkerConfig(batch_size=2))
    reranker.start()
    yield reranker, model, calls
    assert reranker.stop(5)


def test_I_generative_prompt_is_qwen3_reranker_format(
    generative: tuple[GenerativeReranker, TinyCausalLM, list[list[int]]],
) -> None:
    reranker, _, calls = generative
    reranker.rerank_sync(QUERY, DOCUMENTS[:1])
    prompt = RerankPrompt().render(QUERY, DOCUMENTS[0])
    assert prompt == (
        "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
        'the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
        "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that "
        "answer the query\n<Query>: What is a panda?\n<Document>: hi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert calls == [encode(prompt)]


def test_I_generative_score_is_the_yes_no_log_odds(
    generative: tuple[GenerativeReranker, TinyCausalLM, list[list[int]]],
) -> None:
    reranker, model, _ = generative
    result = reranker.rerank_sync(QUERY, DOCUMENTS)  # 5 prompts of different lengths, batches of 2
    for doc, score in zip(DOCUMENTS, result.scores):
        with torch.no_grad():  # the prompt alone, no padding, full softmax over the vocabulary
            last = model(torch.tensor([encode(RerankPrompt().render(QUERY, doc))]))[0, -1]
        probs = torch.softmax(last, dim=-1)
        p_yes = float(probs[YES] / (probs[YES] + probs[NO]))  # Qwen3-Reranker's score
        assert torch.sigmoid(torch.tensor(score)).item() == pytest.approx(p_yes, abs=1e-5)
        assert score == pytest.approx(float(last[YES] - last[NO]), abs=1e-4)
    assert len(set(round(s, 4) for s in result.scores)) == len(DOCUMENTS)


def test_I_generative_truncation_keeps_the_answer_cue() -> None:
    model = TinyCausalLM()
    reranker = GenerativeReranker(model.last_logits, encode, window=300)
    long_doc = "bamboo " * 100
    with pytest.raises(InputTooLongError, match="document 0 makes a prompt of .* more than the window of 300"):
        reranker.encode(QUERY, [long_doc], truncate=False)
    [prompt] = reranker.encode(QUERY, [long_doc], truncate=True)
    suffix = encode(RerankPrompt().suffix)
    assert len(prompt.token_ids) == 300 and prompt.token_ids[-len(suffix) :] == suffix


def test_I_answers_must_be_single_tokens() -> None:
    assert answer_token_ids(encode) == (YES, NO)
    with pytest.raises(ModelLoadError, match="'yes' is 3 tokens"):
        answer_token_ids(lambda text: list(text.encode()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_I_cross_encoder_on_cuda_matches_cpu(cross_dir: Path) -> None:
    cuda = RerankProvider.load(cross_dir, RerankConfig(device="cuda"))
    try:
        got = cuda.rerank_sync(QUERY, DOCUMENTS).scores
    finally:
        cuda.stop(5)
    assert got == pytest.approx(transformers_scores(cross_dir, QUERY, DOCUMENTS), abs=1e-3)
