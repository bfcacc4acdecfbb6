"""Rerank providers (spec I, F3): score (query, document) pairs on a worker thread.

Two kinds share the `Reranker` interface the API adapter calls:
- `RerankProvider`: a 1-label cross-encoder (`*ForSequenceClassification`), its logit per
  pair.
- `GenerativeReranker`: a causal LM asked "does the document answer the query, yes or
  no?" in the Qwen3-Reranker prompt; the score is logit(yes) - logit(no) at the last
  position, so sigmoid(score) is P(yes) over {yes, no}, Qwen3-Reranker's own score.
Both return raw scores (logits); the protocol adapter decides whether to squash them.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from mlxcel.loading.errors import ModelLoadError
from mlxcel.workers.base import BatchWorker, WorkerConfig, WorkerStats
from mlxcel.workers.encoder_inputs import (
    EncodedInput,
    InputError,
    InputTooLongError,
    encode_pairs,
    load_tokenizer,
    model_window,
    pad_batch,
    parse_dtype,
)

DEFAULT_RERANK_BATCH_SIZE = 8  # text pairs per forward when --rerank-batch-size is 0
RERANK_WORKER_DEFAULTS = WorkerConfig(queue_depth=8, batch_size=DEFAULT_RERANK_BATCH_SIZE, request_timeout_s=120.0)

# One model call: token id lists in, last-position logits [batch, vocab] out.
LogitsFn = Callable[[list[list[int]]], torch.Tensor]


@dataclass(frozen=True, slots=True)
class RerankConfig:
    """Server-wide cross-encoder settings (CLI flags)."""

    device: str = "cpu"
    dtype: str = "float32"
    worker: WorkerConfig = RERANK_WORKER_DEFAULTS


def rerank_batch_size(flag_value: int) -> int:
    """`--rerank-batch-size`: 0 means the default of 8 text pairs."""
    if flag_value < 0:
        raise ValueError(f"--rerank-batch-size must be 0 (default) or positive, not {flag_value}")
    return flag_value or DEFAULT_RERANK_BATCH_SIZE


@dataclass(frozen=True, slots=True)
class RerankResult:
    scores: list[float]  # raw score per document, in the request's order
    num_prompt_tokens: int  # all pairs together, after truncation


class Reranker(Protocol):
    """What the rerank routes call."""

    async def rerank(self, query: str, documents: Sequence[str], truncate: bool = False) -> RerankResult: ...

    def stats(self) -> WorkerStats: ...

    def stop(self, timeout: float | None = None) -> bool: ...


class _WorkerReranker(abc.ABC):
    """The worker plumbing both kinds share: encode on the caller, score on the thread."""

    worker: BatchWorker[EncodedInput, float]

    @abc.abstractmethod
    def encode(self, query: str, documents: Sequence[str], truncate: bool) -> list[EncodedInput]:
        """One model input per document, within the window (InputTooLongError otherwise)."""

    def start(self) -> None:
        self.worker.start()

    def stop(self, timeout: float | None = None) -> bool:
        return self.worker.stop(timeout)

    def stats(self) -> WorkerStats:
        return self.worker.stats()

    async def rerank(self, query: str, documents: Sequence[str], truncate: bool = False) -> RerankResult:
        """Raw scores of `documents` against `query`; InputError (400), worker errors (503/504)."""
        pairs = self._checked_encode(query, documents, truncate)
        return self._result(pairs, await self.worker.run(pairs))

    def rerank_sync(self, query: str, documents: Sequence[str], truncate: bool = False) -> RerankResult:
        """Blocking `rerank`, for callers without an event loop."""
        pairs = self._checked_encode(query, documents, truncate)
        return self._result(pairs, self.worker.run_sync(pairs))

    def _checked_encode(self, query: str, documents: Sequence[str], truncate: bool) -> list[EncodedInput]:
        if not documents:
            raise InputError("documents must not be empty")
        return self.encode(query, documents, truncate)

    @staticmethod
    def _result(pairs: list[EncodedInput], scores: list[float]) -> RerankResult:
        return RerankResult(list(scores), sum(len(pair.token_ids) for pair in pairs))


class CrossEncoder:
    """A 1-label sequence-classification encoder and its tokenizer; no threads here."""

    def __init__(self, folder: str | Path, config: RerankConfig = RerankConfig()) -> None:
        from mlxcel.loading import encoder

        self.folder = Path(folder)
        self.device = torch.device(config.device)
        self.model = encoder.load_classifier(self.folder, device=config.device, dtype=parse_dtype(config.dtype))
        args = self.model.bert.args
        if args.num_labels != 1:
            raise ModelLoadError(f"{folder}: the classifier has {args.num_labels} labels; a reranker needs 1")
        self.tokenizer = load_tokenizer(self.folder)
        self.pad_id = args.pad_token_id
        self.window = model_window(self.folder, args.max_position_embeddings)

    def encode(self, query: str, documents: Sequence[str], truncate: bool) -> list[EncodedInput]:
        return encode_pairs(self.tokenizer, query, documents, self.window, truncate)

    def forward(self, batch: list[EncodedInput]) -> list[float]:
        input_ids, mask, type_ids = pad_batch(batch, self.pad_id, self.device)
        with torch.inference_mode():
            logits = self.model(input_ids, mask, type_ids)  # [batch, 1]
        return logits[:, 0].float().cpu().tolist()


class RerankProvider(_WorkerReranker):
    """A cross-encoder served by its own worker thread."""

    def __init__(self, model: CrossEncoder, worker: WorkerConfig = RERANK_WORKER_DEFAULTS) -> None:
        self.model = model
        self.worker = BatchWorker("rerank", model.forward, worker, sort_key=lambda p: len(p.token_ids))

    @classmethod
    def load(cls, folder: str | Path, config: RerankConfig = RerankConfig()) -> RerankProvider:
        """Load the checkpoint and start the worker thread."""
        provider = cls(CrossEncoder(folder, config), config.worker)
        provider.start()
        return provider

    def encode(self, query: str, documents: Sequence[str], truncate: bool) -> list[EncodedInput]:
        return self.model.encode(query, documents, truncate)


@dataclass(frozen=True, slots=True)
class RerankPrompt:
    """The yes/no judging prompt; defaults are Qwen3-Reranker's, in ChatML."""

    prefix: str = (
        "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
        'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
        "<|im_start|>user\n"
    )
    suffix: str = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    instruction: str = "Given a web search query, retrieve relevant passages that answer the query"

    def body(self, query: str, document: str) -> str:
        return f"<Instruct>: {self.instruction}\n<Query>: {query}\n<Document>: {document}"

    def render(self, query: str, document: str) -> str:
        """The whole prompt as one string (what the model reads)."""
        return self.prefix + self.body(query, document) + self.suffix


def answer_token_ids(encode: Callable[[str], list[int]]) -> tuple[int, int]:
    """(yes_id, no_id): each answer must be one token in this tokenizer."""
    ids = {word: encode(word) for word in ("yes", "no")}
    for word, tokens in ids.items():
        if len(tokens) != 1:
            raise ModelLoadError(f"generative reranker: {word!r} is {len(tokens)} tokens, not one")
    return ids["yes"][0], ids["no"][0]


class GenerativeReranker(_WorkerReranker):
    """Scores pairs with a causal LM's last-position yes/no logits (Qwen3-Reranker style).

    `encode` turns text into token ids, reading ChatML markers as special tokens;
    `logits_fn` runs the model on a batch of token id lists and returns the logits at
    each list's last position, [batch, vocab]. Both come from the chat model's owner.
    """

    def __init__(
        self,
        logits_fn: LogitsFn,
        encode: Callable[[str], list[int]],
        window: int,
        prompt: RerankPrompt = RerankPrompt(),
        worker: WorkerConfig = RERANK_WORKER_DEFAULTS,
    ) -> None:
        self.logits_fn = logits_fn
        self.encode_text = encode
        self.window = window
        self.prompt = prompt
        self.yes_id, self.no_id = answer_token_ids(encode)
        self.prefix_ids = encode(prompt.prefix)
        self.suffix_ids = encode(prompt.suffix)
        self.worker = BatchWorker("rerank", self.forward, worker, sort_key=lambda p: len(p.token_ids))

    def encode(self, query: str, documents: Sequence[str], truncate: bool) -> list[EncodedInput]:
        budget = self.window - len(self.prefix_ids) - len(self.suffix_ids)
        if budget < 1:
            raise InputTooLongError(f"the rerank prompt alone fills the window of {self.window} tokens")
        return [self._encode_pair(query, doc, index, budget, truncate) for index, doc in enumerate(documents)]

    def forward(self, batch: list[EncodedInput]) -> list[float]:
        """logit(yes) - logit(no) at each prompt's last position."""
        logits = self.logits_fn([item.token_ids for item in batch])  # [batch, vocab]
        answers = logits[:, [self.no_id, self.yes_id]].float()
        return (answers[:, 1] - answers[:, 0]).cpu().tolist()

    def _encode_pair(self, query: str, document: str, index: int, budget: int, truncate: bool) -> EncodedInput:
        # Prefix, body and suffix are tokenized apart (as Qwen3-Reranker's reference code
        # does) so truncation cuts only the body's end and keeps the answer cue intact.
        body = self.encode_text(self.prompt.body(query, document))
        if len(body) > budget:
            if not truncate:
                total = len(body) + len(self.prefix_ids) + len(self.suffix_ids)
                raise InputTooLongError(
                    f"document {index} makes a prompt of {total} tokens, more than the window of "
                    f"{self.window} tokens; shorten it or set \"truncate\": true"
                )
            body = body[:budget]
        return EncodedInput(self.prefix_ids + body + self.suffix_ids)
