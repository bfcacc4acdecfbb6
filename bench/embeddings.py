"""Embeddings throughput: mlxcel's embedding provider vs sentence-transformers (spec I).

Both run all-MiniLM-L6-v2 in this process with the same torch thread count on the same
sentences; for each batch size, sentences/s of each and the ratio (target >= 1.0x at 16).
mlxcel is measured through its worker (queue, thread, tokenization, pooling,
normalization), sentence-transformers through `encode`; both sort by length before
batching. Only same-run ratios mean anything on a shared machine.

    .venv/bin/python bench/embeddings.py                       # 512 sentences, batch 1/16/64
    .venv/bin/python bench/embeddings.py --sentences 32 --batch-sizes 1,16 --rounds 1
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mlxcel.loading.packaged import resolve_packaged  # noqa: E402
from mlxcel.workers.base import WorkerConfig  # noqa: E402
from mlxcel.workers.embedding import EmbeddingModel, EmbeddingProvider  # noqa: E402

WORDS = (
    "the model reads a sentence and returns one vector whose direction carries its meaning "
    "so that close sentences point the same way search engines rank passages by that angle "
    "café naïve über 日本語 🙂 numbers 42 and 3.14 appear too"
).split()


def make_sentences(count: int, seed: int = 0) -> list[str]:
    """Sentences of 4 to 60 words, a spread like real queries and passages."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(4, 60))) for _ in range(count)]


def best_rate(run: Callable[[], object], num_sentences: int, rounds: int) -> float:
    """Sentences per second of the fastest round."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return num_sentences / best


def measure(folder: Path, sentences: list[str], batch_sizes: list[int], rounds: int) -> list[tuple[int, float, float]]:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    model = EmbeddingModel(folder)
    rows = []
    for batch_size in batch_sizes:
        provider = EmbeddingProvider(model, WorkerConfig(batch_size=batch_size, request_timeout_s=3600))
        provider.start()
        try:
            check_agreement(provider, reference, sentences[:8])
            ours = best_rate(lambda: provider.embed_sync(sentences), len(sentences), rounds)
        finally:
            provider.stop(10)
        theirs = best_rate(lambda: reference.encode(sentences, batch_size=batch_size), len(sentences), rounds)
        rows.append((batch_size, ours, theirs))
    return rows


def check_agreement(provider: EmbeddingProvider, reference: object, sentences: list[str]) -> None:
    """Also the warm-up: both stacks embed a few sentences and must agree."""
    ours = np.stack(provider.embed_sync(sentences).embeddings)
    theirs = reference.encode(sentences, convert_to_numpy=True)  # type: ignore[attr-defined]
    cosines = (ours * theirs).sum(axis=1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))
    if cosines.min() < 0.9999:
        raise SystemExit(f"outputs disagree: min cosine {cosines.min():.6f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both stacks")
    parser.add_argument("--sentences", type=int, default=512)
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=3, help="best of N timed rounds")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = resolve_packaged("all-minilm-l6-v2")
    sentences = make_sentences(args.sentences)
    batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    rows = measure(folder, sentences, batch_sizes, args.rounds)
    print(f"all-MiniLM-L6-v2, {len(sentences)} sentences, {args.threads} thread(s), best of {args.rounds}")
    print(f"{'batch':>5}  {'mlxcel sent/s':>14}  {'sentence-transformers':>21}  {'ratio':>6}")
    for batch_size, ours, theirs in rows:
        print(f"{batch_size:>5}  {ours:>14.1f}  {theirs:>21.1f}  {ours / theirs:>5.2f}x")


if __name__ == "__main__":
    main()
