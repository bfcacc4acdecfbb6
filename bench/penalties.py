"""The penalties' cost in a sampling step, counted afresh against kept counts (issue 25; see bench/RESULTS.md):

    PYTHONPATH=src python3 bench/penalties.py [--device cpu|cuda] [--rows 16,64,256] [--vocabs 49152,151936]

Each step samples a batch of rows (temperature 0.8, top_p 0.95) whose histories grow by one token
a step, as the engine's do: with no penalty, with repetition_penalty 1.1 over the default 64-token
window, and over the whole context (repeat_last_n -1, histories of 2,000 tokens); the penalized
shapes twice, their counts scattered afresh each step (`sample(..., counts=None)`) and kept between
steps (`PenaltyCounts`, what the engine passes). Reported: ms per step, the median of the steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mlxcel.engine.sampler import PenaltyCounts, SamplingRow, make_generator, sample
from mlxcel.types import SamplingParams

SHAPES = {  # name: (extra sampling fields, history length at the start)
    "no penalty": ({}, 64),
    "window 64": ({"repetition_penalty": 1.1}, 64),
    "whole context": ({"repetition_penalty": 1.1, "repeat_last_n": -1}, 2000),
}


def step_ms(rows_n: int, vocab: int, fields: dict, history: int, kept: bool, device: str, steps: int) -> float:
    g = torch.Generator().manual_seed(rows_n)
    logits = torch.randn(rows_n, vocab, generator=g) * 2  # a trained model's spread: a few dozen likely tokens
    logits[:, :64] += torch.linspace(16, 6, 64)
    logits = logits.to(device)
    params = SamplingParams(temperature=0.8, top_p=0.95, **fields)
    rows = [SamplingRow(params, torch.randint(0, vocab, (history,), generator=g).tolist(), 3, frozenset(),
                        make_generator(None), owner=f"r{i}") for i in range(rows_n)]
    table = PenaltyCounts() if kept else None
    times = []
    for step in range(steps + 3):
        start = time.perf_counter()
        tokens, _ = sample(logits, rows, table)
        if step >= 3:  # the first steps count every window afresh either way
            times.append((time.perf_counter() - start) * 1000)
        for r, t in zip(rows, tokens):
            r.history.append(t)
    return round(statistics.median(times), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", default="16,64,256")
    parser.add_argument("--vocabs", default="49152,151936")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {}
    for vocab in map(int, args.vocabs.split(",")):
        for rows_n in map(int, args.rows.split(",")):
            for name, (fields, history) in SHAPES.items():
                for kept in (False, True) if fields else (False,):
                    label = f"{vocab} x {rows_n}, {name}" + ("" if not fields else ", kept" if kept else ", afresh")
                    report[label] = step_ms(rows_n, vocab, fields, history, kept, args.device, args.steps)
                    print(f"{label}: {report[label]} ms", flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
