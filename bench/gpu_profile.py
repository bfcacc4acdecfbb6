"""Where a CUDA-graph decode step's time goes, on the lent GPU (see bench/RESULTS.md):

    python3 bench/gpu_profile.py [--configs 1x1024,64x65536] [--kernels] [--qwen15]

A random-weight SmolLM2-shaped model. For each engine configuration (slots x pool tokens): the
engine's own step driven on this thread (ms a step, then the top of a cProfile of 100 steps), and
the same engine through its asyncio client with the loop on its own thread (ms a token, one
request at a time). `--kernels` adds a torch.profiler table of the GPU kernels of 20 steps.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from gpu_check import QWEN15_SHAPE, random_checkpoint  # noqa: E402

from mlxcel.config import EngineConfig  # noqa: E402
from mlxcel.engine.client import EngineClient  # noqa: E402
from mlxcel.engine.loop import EngineCore, ModelShape  # noqa: E402
from mlxcel.layers.quant import fuse_projections  # noqa: E402
from mlxcel.loading import load_model  # noqa: E402
from mlxcel.types import Request, SamplingParams  # noqa: E402


def make_core(loaded, slots: int, ctx: int) -> EngineCore:  # noqa: ANN001
    config = EngineConfig(max_num_seqs=slots, ctx_size=ctx, max_num_batched_tokens=2048, decode_step="cuda-graph")
    core = EngineCore(loaded.model, ModelShape.of(loaded.model.args), config, eos_token_ids=frozenset(),
                      device="cuda", dtype=torch.bfloat16)
    started = time.perf_counter()
    core.warm_decode_step()
    print(f"[{slots}x{ctx}] warm {time.perf_counter() - started:.1f} s", flush=True)
    return core


def step_profile(core: EngineCore, label: str, kernels: bool) -> None:
    core.submit(Request("a", list(range(100, 228)), SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)),
                lambda event: None)
    core._drain_inbox(block=False)
    for _ in range(20):
        core._step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(100):
        core._step()
    torch.cuda.synchronize()
    print(f"[{label}] engine step on this thread: {10 * (time.perf_counter() - started):.3f} ms", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(100):
        core._step()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(14)
    print(text.getvalue()[:4000], flush=True)
    if kernels:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                core._step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70), flush=True)
    core.abort("a")
    core._drain_inbox(block=False)
    core._step()


async def one_request(client: EngineClient, n: int) -> int:
    count = 0
    request = Request(f"c{time.monotonic_ns()}", list(range(300, 428)),
                      SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    async for event in client.generate(request):
        count += len(event.token_ids)
    return count


def client_profile(core: EngineCore, label: str) -> None:
    core.start()
    client = EngineClient(core)
    asyncio.run(one_request(client, 8))
    started = time.perf_counter()
    count = asyncio.run(one_request(client, 300))
    print(f"[{label}] client path: {1000 * (time.perf_counter() - started) / count:.2f} ms/token", flush=True)
    core.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="1x1024,64x65536", help="slots x pool tokens, comma-separated")
    parser.add_argument("--kernels", action="store_true")
    parser.add_argument("--qwen15", action="store_true", help="a random Qwen2.5-1.5B shape instead of SmolLM2's")
    args = parser.parse_args()
    path = (random_checkpoint(Path("/tmp/qwen15-random"), QWEN15_SHAPE, family="qwen2") if args.qwen15
            else random_checkpoint(Path("/tmp/smol-random")))
    loaded = load_model(path, device="cuda", dtype=torch.bfloat16)
    if os.environ.get("MLXCEL_FUSE", "1") == "1":
        print("fused projections:", fuse_projections(loaded.model), flush=True)  # as serving.served_model does on CUDA
    for config in args.configs.split(","):
        slots, ctx = map(int, config.split("x"))
        core = make_core(loaded, slots, ctx)
        step_profile(core, config, args.kernels)
        client_profile(core, config)
        del core
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
