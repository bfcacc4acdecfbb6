"""The decode step alone, in-process: milliseconds a step for eager vs compiled (CPU) or CUDA graphs.

    PYTHONPATH=src python3 bench/decode_step.py [--gguf PATH] [--device cpu|cuda] [--threads 2]
        [--modes eager,compile] [--rows 1,8] [--contexts 128,4000]

Without --gguf a random-weight checkpoint of SmolLM2's shape is built (int8 decode matmuls on
CPU instead of the real file's 4-bit). Prints a JSON line per (mode, rows, context) with the
median and best step time and, once per mode, the time the first call took (compile/capture).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def load(gguf: Path | None, device: str) -> torch.nn.Module:
    from mlxcel.layers.quant import quantize
    from mlxcel.loading import load_model

    if gguf is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from gpu_check import random_checkpoint

        gguf = random_checkpoint(Path("/tmp/smol-random"))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = load_model(gguf, device=device, dtype=dtype).model.eval()
    if device == "cpu":
        print(quantize(model), file=sys.stderr)
    return model


def measure(model: torch.nn.Module, device: str, mode: str, rows: list[int], contexts: list[int], steps: int) -> None:
    from mlxcel.engine.decode_step import DecodeRow, DecodeStep
    from mlxcel.engine.kv.tensors import KVCache

    args = model.args
    block = 16
    blocks_per_row = max(contexts) // block + 2
    kv = KVCache(args.num_hidden_layers, blocks_per_row * max(rows), block, args.kv_heads, args.dim_per_head,
                 torch.bfloat16, device)
    step = DecodeStep(model, kv, device, mode=mode, max_rows=max(rows), max_positions=max(contexts) + 64,
                      cache_dir=Path("/tmp/mlxcel-bench-compile-cache"))
    started = time.perf_counter()
    step.warm(num_positions=min(contexts))
    first = time.perf_counter() - started
    for num_rows in rows:
        for context in contexts:
            batch = [DecodeRow(100 + b, context - 1, 0, tuple(range(b * blocks_per_row, (b + 1) * blocks_per_row)))
                     for b in range(num_rows)]
            for _ in range(3):
                step.run(batch)
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step.run(batch)
                times.append(time.perf_counter() - t0)
            times.sort()
            print(json.dumps({"mode": mode, "rows": num_rows, "context": context, "first_call_s": round(first, 1),
                              "median_ms": round(1000 * times[len(times) // 2], 2),
                              "best_ms": round(1000 * times[0], 2)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", default="eager,compile")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--contexts", default="128,4000")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load(args.gguf, args.device)
    with torch.inference_mode():
        for mode in args.modes.split(","):
            measure(model, args.device, mode, [int(r) for r in args.rows.split(",")],
                    [int(c) for c in args.contexts.split(",")], args.steps)


if __name__ == "__main__":
    main()
