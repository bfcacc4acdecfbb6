"""The embedding provider (spec I): an encoder checkpoint behind a `BatchWorker`.

Pooling and normalization come from the checkpoint's sentence-transformers files
(`modules.json`, `1_Pooling/config.json`) unless `--pooling` / `--embd-normalize` override
them. Normalization follows llama-server's `--embd-normalize`: -1 none, 0 max-abs scaled
to int16, 1 taxicab, 2 euclidean, >2 p-norm.

`dimensions` (OpenAI) truncates then renormalizes, but only for a model that declares
Matryoshka training in config.json (`matryoshka_dimensions: [..]` or
`is_matryoshka: true`, vLLM's convention): cutting a vector the model was not trained to
cut gives a worse embedding without saying so, so all-MiniLM-L6-v2 refuses it (400).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mlxcel.loading.encoder import load_model as load_encoder
from mlxcel.loading.errors import ModelLoadError
from mlxcel.workers.base import BatchWorker, WorkerConfig, WorkerStats
from mlxcel.workers.encoder_inputs import (
    EncodedInput,
    InputError,
    InputTooLongError,
    encode_texts,
    load_tokenizer,
    model_window,
    pad_batch,
    parse_dtype,
)

EMBEDDING_WORKER_DEFAULTS = WorkerConfig(queue_depth=8, batch_size=16, request_timeout_s=120.0)


class PoolingType(str, enum.Enum):
    MEAN = "mean"
    CLS = "cls"
    LAST = "last"
    NONE = "none"  # one vector per token (llama-server native route only)


# sentence-transformers pooling modes this provider computes, by their config name.
_ST_POOLING = {"mean": PoolingType.MEAN, "cls": PoolingType.CLS, "lasttoken": PoolingType.LAST}
_ST_LEGACY_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


@dataclass(frozen=True, slots=True)
class EmbeddingConfig:
    """Server-wide embedding settings (CLI flags)."""

    pooling: PoolingType | None = None  # None = the checkpoint's
    normalize: int | None = None  # --embd-normalize; None = the checkpoint's
    device: str = "cpu"
    dtype: str = "float32"
    worker: WorkerConfig = EMBEDDING_WORKER_DEFAULTS


@dataclass(frozen=True, slots=True)
class CheckpointPooling:
    """What a checkpoint's sentence-transformers files declare (None = not declared)."""

    pooling: PoolingType | None
    unsupported_mode: str | None  # e.g. "max": fine only when --pooling overrides it
    normalize: int  # -1 or 2


@dataclass(frozen=True, slots=True)
class EmbeddingResult:
    """Per input: a [dim] vector, or [num_tokens, dim] with pooling none."""

    embeddings: list[np.ndarray]
    num_prompt_tokens: list[int]
    is_per_token: bool

    @property
    def total_prompt_tokens(self) -> int:
        return sum(self.num_prompt_tokens)


@dataclass(frozen=True, slots=True)
class EmbeddingOptions:
    """Per-request options."""

    truncate: bool = False
    dimensions: int | None = None
    normalize: int | None = None  # llama-server's per-request embd_normalize; None = server's


def read_checkpoint_pooling(folder: str | Path) -> CheckpointPooling:
    """Pooling and normalization from modules.json and the Pooling module's config.

    Without modules.json (a plain encoder checkpoint) this is mean pooling with euclidean
    normalization, llama-server's default.
    """
    modules_path = Path(folder) / "modules.json"
    if not modules_path.is_file():
        return CheckpointPooling(PoolingType.MEAN, None, 2)
    pooling, unsupported, normalize = PoolingType.MEAN, None, -1
    for module in json.loads(modules_path.read_text()):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            pooling, unsupported = _pooling_mode(Path(folder) / module.get("path", ""))
        elif kind == "Normalize":
            normalize = 2
        elif kind != "Transformer" or module.get("path", ""):
            raise ModelLoadError(
                f"{folder}: sentence-transformers module {module.get('type')!r} "
                f"({module.get('path')!r}) is not supported (Transformer at the root, Pooling, Normalize)"
            )
    return CheckpointPooling(pooling, unsupported, normalize)


def _pooling_mode(module_folder: Path) -> tuple[PoolingType | None, str | None]:
    config: dict[str, Any] = json.loads((module_folder / "config.json").read_text())
    mode = config.get("pooling_mode")
    if mode is None:  # sentence-transformers < 6: one boolean per mode; none set = mean
        active = [name for key, name in _ST_LEGACY_KEYS.items() if config.get(key)]
        mode = active if len(active) != 1 else active[0]
        mode = mode or "mean"
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if isinstance(mode, str) and mode in _ST_POOLING:
        return _ST_POOLING[mode], None
    return None, "+".join(mode) if isinstance(mode, list) else str(mode)


def normalize_embedding(vector: np.ndarray, norm: int) -> np.ndarray:
    """llama-server's `common_embd_normalize` on one vector (float64 sum, as there)."""
    values = vector.astype(np.float64)
    if norm < 0:
        return vector
    if norm == 0:
        total = np.abs(values).max(initial=0.0) / 32760.0  # scaled into int16 range
    elif norm == 2:
        total = np.sqrt(np.square(values).sum())
    else:
        total = np.power(np.power(np.abs(values), norm).sum(), 1.0 / norm)
    scale = 1.0 / total if total > 0.0 else 0.0
    return (values * scale).astype(np.float32)


class EmbeddingModel:
    """Encoder + tokenizer + pooling: the compute a provider's thread runs, no threads here."""

    def __init__(self, folder: str | Path, config: EmbeddingConfig = EmbeddingConfig()) -> None:
        self.folder = Path(folder)
        self.device = torch.device(config.device)
        self.encoder = load_encoder(self.folder, config.device, parse_dtype(config.dtype))
        self.tokenizer = load_tokenizer(self.folder)
        args = self.encoder.args
        self.dim: int = args.hidden_size
        self.vocab_size: int = args.vocab_size
        self.pad_id: int = args.pad_token_id
        self.window = model_window(self.folder, args.max_position_embeddings)
        self.pooling, self.normalize = _resolve_pooling(self.folder, config)
        # () = no shorter vectors; None = any length (is_matryoshka without a list)
        self.matryoshka_dims = _matryoshka_dims(self.folder, self.dim)

    def encode(self, inputs: Sequence[str | Sequence[int]], truncate: bool) -> list[EncodedInput]:
        """Token ids for each input (text, or token ids used as given: no specials added)."""
        if not inputs:
            raise InputError("input must not be empty")
        encoded: dict[int, EncodedInput] = {}
        text_indices = [index for index, item in enumerate(inputs) if isinstance(item, str)]
        texts = [str(inputs[index]) for index in text_indices]
        for index, item in zip(text_indices, self._encode_texts(texts, text_indices, truncate)):
            encoded[index] = item
        for index, item in enumerate(inputs):
            if not isinstance(item, str):
                encoded[index] = self._encode_ids(item, index, truncate)
        return [encoded[index] for index in range(len(inputs))]

    def forward(self, batch: list[EncodedInput]) -> list[np.ndarray]:
        """Pooled vectors (not normalized) or per-token rows for one padded batch."""
        input_ids, mask, type_ids = pad_batch(batch, self.pad_id, self.device)
        with torch.inference_mode():
            hidden = self.encoder(input_ids, mask, type_ids)  # [batch, seq, dim]
            pooled = _pool(hidden, mask, self.pooling).float().cpu()
        lengths = [len(item.token_ids) for item in batch]
        if self.pooling is PoolingType.NONE:
            return [pooled[row, :length].numpy() for row, length in enumerate(lengths)]
        return list(pooled.numpy())

    def finish(self, vector: np.ndarray, options: EmbeddingOptions) -> np.ndarray:
        """Apply `dimensions` and the normalization to one pooled vector."""
        if self.pooling is PoolingType.NONE:
            return vector  # per-token rows stay raw, as llama-server returns them
        if options.dimensions is not None and options.dimensions != self.dim:
            vector = vector[: options.dimensions]
        norm = self.normalize if options.normalize is None else options.normalize
        return normalize_embedding(vector, norm)

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None or dimensions == self.dim:
            return
        if self.matryoshka_dims == ():
            raise InputError(
                f"this embedding model does not support 'dimensions' other than {self.dim} "
                "(it declares no Matryoshka dimensions)"
            )
        if self.matryoshka_dims is None and not 0 < dimensions <= self.dim:
            raise InputError(f"'dimensions' must be between 1 and {self.dim}, not {dimensions}")
        if self.matryoshka_dims is not None and dimensions not in self.matryoshka_dims:
            allowed = ", ".join(str(d) for d in self.matryoshka_dims)
            raise InputError(f"'dimensions' must be one of {allowed}, not {dimensions}")

    def _encode_texts(self, texts: list[str], indices: list[int], truncate: bool) -> list[EncodedInput]:
        if not texts:
            return []
        for text, index in zip(texts, indices):
            if not text:
                raise InputError(f"input {index} is an empty string")
        return encode_texts(self.tokenizer, texts, self.window, truncate, indices)

    def _encode_ids(self, item: Sequence[int], index: int, truncate: bool) -> EncodedInput:
        ids = list(item)
        if not ids:
            raise InputError(f"input {index} has no tokens")
        if any(not 0 <= token < self.vocab_size for token in ids):
            raise InputError(f"input {index} has a token id outside the vocabulary [0, {self.vocab_size})")
        if len(ids) > self.window and not truncate:
            raise InputTooLongError(
                f"input {index} has {len(ids)} tokens, more than the model's window of "
                f"{self.window} tokens; shorten it or set \"truncate\": true"
            )
        return EncodedInput(ids[: self.window])


class EmbeddingProvider:
    """An embedding model served by its own worker thread (bounded queue, deadline)."""

    def __init__(self, model: EmbeddingModel, worker: WorkerConfig = EMBEDDING_WORKER_DEFAULTS) -> None:
        self.model = model
        self.worker: BatchWorker[EncodedInput, np.ndarray] = BatchWorker(
            "embedding", model.forward, worker, sort_key=lambda item: len(item.token_ids)
        )

    @classmethod
    def load(cls, folder: str | Path, config: EmbeddingConfig = EmbeddingConfig()) -> EmbeddingProvider:
        """Load the checkpoint and start the worker thread."""
        provider = cls(EmbeddingModel(folder, config), config.worker)
        provider.start()
        return provider

    @property
    def pooling(self) -> PoolingType:
        return self.model.pooling

    def start(self) -> None:
        self.worker.start()

    def stop(self, timeout: float | None = None) -> bool:
        return self.worker.stop(timeout)

    def stats(self) -> WorkerStats:
        return self.worker.stats()

    async def embed(
        self, inputs: Sequence[str | Sequence[int]], options: EmbeddingOptions = EmbeddingOptions()
    ) -> EmbeddingResult:
        """Embeddings of `inputs`; InputError (400), WorkerBusyError (503), WorkerTimeoutError (504)."""
        encoded = self._prepare(inputs, options)
        return self._result(encoded, await self.worker.run(encoded), options)

    def embed_sync(
        self, inputs: Sequence[str | Sequence[int]], options: EmbeddingOptions = EmbeddingOptions()
    ) -> EmbeddingResult:
        """Blocking `embed`, for callers without an event loop (CLI, benchmarks)."""
        encoded = self._prepare(inputs, options)
        return self._result(encoded, self.worker.run_sync(encoded), options)

    def _prepare(self, inputs: Sequence[str | Sequence[int]], options: EmbeddingOptions) -> list[EncodedInput]:
        # Tokenizing here, on the caller's thread, answers a bad input with a 400 before it
        # takes a queue slot; `tokenizers` is safe to share across threads.
        self.model.check_dimensions(options.dimensions)
        return self.model.encode(inputs, options.truncate)

    def _result(
        self, encoded: list[EncodedInput], outputs: list[np.ndarray], options: EmbeddingOptions
    ) -> EmbeddingResult:
        vectors = [self.model.finish(vector, options) for vector in outputs]
        lengths = [len(item.token_ids) for item in encoded]
        return EmbeddingResult(vectors, lengths, self.model.pooling is PoolingType.NONE)


def _pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: PoolingType) -> torch.Tensor:
    if pooling is PoolingType.CLS:
        return hidden[:, 0]
    if pooling is PoolingType.LAST:  # right padding: the last real token of each row
        last = mask.sum(dim=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    if pooling is PoolingType.MEAN:
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
    return hidden


def _resolve_pooling(folder: Path, config: EmbeddingConfig) -> tuple[PoolingType, int]:
    declared = read_checkpoint_pooling(folder)
    pooling = config.pooling or declared.pooling
    if pooling is None:
        raise ModelLoadError(
            f"{folder}: pooling mode {declared.unsupported_mode!r} is not supported; "
            "choose one with --pooling mean|cls|last|none"
        )
    normalize = declared.normalize if config.normalize is None else config.normalize
    return pooling, normalize


def _matryoshka_dims(folder: Path, dim: int) -> tuple[int, ...] | None:
    config = json.loads((folder / "config.json").read_text())
    declared = config.get("matryoshka_dimensions")
    if declared:
        return tuple(sorted(int(d) for d in declared if 0 < int(d) <= dim))
    return None if config.get("is_matryoshka") else ()

