"""Issue 25 point 3 in-process: where the time of a partial prefix hit goes on the real engine (no HTTP).

    PYTHONPATH=src .venv/bin/python bench/prefix_tail_parts.py --new 2 --repeats 12 [--disk-size 1G]

Loads the default model (SmolLM2 Q4_1, 2 threads), sends a 2,000-token prompt cold, then `--repeats`
prompts that extend it by `--new` tokens (each a partial hit of 2,000 cached tokens), and prints each
hit's time to first token beside the wall time spent in the KV reads, the tail's attention and the
whole prefill (wrapped methods; wall time, so a shared machine's noise shows: read the fastest rows).
With --disk-size the disk tier is on (an empty folder), as bench/run.py's servers run.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import statistics
import tempfile
import time

import torch

from mlxcel.config import EngineConfig
from mlxcel.engine import runner
from mlxcel.engine.kv import tensors
from mlxcel.layers import attention
from mlxcel.loading import resolve_model
from mlxcel.serving.chat_model import start_served_model
from mlxcel.serving.served_model import RuntimeOptions
from mlxcel.types import Request, SamplingParams

PARTS: collections.Counter[str] = collections.Counter()
TIMING = [False]


def time_method(cls: type, name: str) -> None:
    method = getattr(cls, name)

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = method(*args, **kwargs)
        if TIMING[0]:
            PARTS[name] += time.perf_counter() - start
        return result

    setattr(cls, name, wrapper)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


async def first_token_s(engine, prompt: list[int], request_id: str) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    async for event in engine.generate(Request(request_id, prompt, params)):
        if event.token_ids:
            return time.perf_counter() - start
    raise RuntimeError("no token")


async def measure(engine, prefix: list[int], new: int, repeats: int, pause: float) -> list[tuple[float, dict]]:
    await first_token_s(engine, prefix, "cold")
    rows = []
    for i in range(repeats):
        await asyncio.sleep(pause)
        PARTS.clear()
        TIMING[0] = True
        seconds = await first_token_s(engine, prefix + [(1000 + 7 * i + j) % 40000 for j in range(new)], f"hit-{i}")
        TIMING[0] = False
        rows.append((seconds, dict(PARTS)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new", type=int, default=2, help="new tokens after the 2,000 cached ones")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--disk-size", default="0", help="the disk tier's bound (0 = off), e.g. 1G")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds before each hit (let a writer go idle)")
    args = parser.parse_args()
    for cls, name in ((tensors.KVCache, "read"), (attention.AttentionContext, "_attend_prefill"),
                      (runner.Runner, "_prefill")):
        time_method(cls, name)
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as folder:  # an empty disk tier, removed afterwards
        config = EngineConfig(max_num_seqs=4, ctx_size=4 * 8192, prefix_cache_dir=folder,
                              prefix_cache_disk_bytes=parse_size(args.disk_size))
        served = start_served_model(resolve_model(None), RuntimeOptions(threads=2), config)
        try:
            prefix = served.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 300)[:2000]
            rows = asyncio.run(measure(served.engine, prefix, args.new, args.repeats, args.pause))
        finally:
            served.close()
    for seconds, parts in sorted(rows, key=lambda row: row[0])[:max(3, len(rows) // 2)]:
        print(f"TTFT {seconds * 1e3:6.1f} ms | " + " ".join(f"{k} {v * 1e3:5.1f}" for k, v in sorted(parts.items())))
    print(f"+{args.new}, disk {args.disk_size}: TTFT min {rows and min(r[0] for r in rows) * 1e3:.1f} ms, "
          f"median {statistics.median(r[0] for r in rows) * 1e3:.1f} ms over {len(rows)}")


if __name__ == "__main__":
    main()
