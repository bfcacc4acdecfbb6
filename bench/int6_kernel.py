"""Issue 27 point 3: the int8 kernel over a GGUF Q6_K weight's codes kept as int8 (a byte a weight) against
the same codes packed in 6 bits (layers/quant.py `int6_blocks`), alternated in one process over enough
copies of each weight to exceed the L3 cache; best of N calls of one row. Prints ms and GB/s a call.

    PYTHONPATH=src python bench/int6_kernel.py [--threads 2] [--repeats 15]
"""

from __future__ import annotations

import argparse
import time

import torch

from mlxcel.layers import paged_attention
from mlxcel.layers.quant import Int8Levels, int6_blocks, int8_blocks, int8_group_scales

L3_BYTES = 32 << 20
SHAPES = {"down_proj 1536 x 8960": (1536, 8960), "head 151936 x 1536": (151936, 1536)}


def q6k_levels(n: int, k: int) -> Int8Levels:
    """Random Q6_K-like codes (-32..31) with scales d x int8 per 16 (float16 units per 256)."""
    unit = (torch.rand(n, k // 256, 1) * 1e-3).half().float()
    subs = torch.randint(-128, 128, (n, k // 16)).float()
    return Int8Levels(torch.randint(-32, 32, (n, k), dtype=torch.int8),
                      unit.repeat_interleave(16, dim=1).squeeze(-1) * subs, None, unit)


def best(fn, x: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor]], repeats: int) -> float:
    times = []
    for i in range(repeats):
        w, s = weights[i % len(weights)]
        start = time.perf_counter()
        fn(x, w, s)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert paged_attention.available(), "no C++ compiler for the CPU kernels"
    op = torch.ops.mlxcel.int8_linear
    for name, (n, k) in SHAPES.items():
        levels = q6k_levels(n, k)
        scales = int8_group_scales(levels)
        forms = {"int8": int8_blocks(levels.codes), "6-bit": int6_blocks(levels.codes)}
        x = torch.randn(1, k)
        assert torch.equal(op(x, forms["int8"], scales), op(x, forms["6-bit"], scales))
        copies = {f: [(w.clone(), scales.clone()) for _ in range(max(2, -(-2 * L3_BYTES // w.nbytes)))]
                  for f, w in forms.items()}
        for round_ in range(args.rounds):
            for form, weights in copies.items():
                seconds = best(op, x, weights, args.repeats)
                size = weights[0][0].nbytes + weights[0][1].nbytes
                print(f"{name:24s} {form:6s} round {round_}: {seconds * 1e3:.3f} ms, {size / 1e6:.1f} MB, "
                      f"{size / seconds / 1e9:.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
