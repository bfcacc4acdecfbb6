"""Where a CUDA-graph decode step's time goes, on the lent GPU (see bench/RESULTS.md):

    python3 bench/gpu_profile.py

A random-weight SmolLM2-shaped model, one slot: the engine's own step driven on this thread
(ms a step, then a cProfile of 100 steps), a bare graph replay, and the same engine through its
asyncio client with the loop on its own thread, at Python's default GIL switch interval and at
the engine's (GIL_SWITCH_INTERVAL_S is set by the loop thread; here it is set by hand first).
"""
import cProfile, pstats, sys, time, io
from pathlib import Path
import torch
sys.path.insert(0, "bench"); sys.path.insert(0, "src")
from gpu_check import random_checkpoint
from mlxcel.config import EngineConfig
from mlxcel.engine.loop import EngineCore, ModelShape
from mlxcel.loading import load_model
from mlxcel.types import Request, SamplingParams

loaded = load_model(random_checkpoint(Path("/tmp/smol-random")), device="cuda", dtype=torch.bfloat16)
for mode in ("cuda-graph",):
    cfg = EngineConfig(max_num_seqs=1, ctx_size=1024, decode_step=mode)
    core = EngineCore(loaded.model, ModelShape.of(loaded.model.args), cfg, eos_token_ids=frozenset(), device="cuda", dtype=torch.bfloat16)
    t = time.perf_counter(); core.warm_decode_step(); print(mode, "warm", time.perf_counter() - t, flush=True)
    events = []
    core.submit(Request("a", list(range(100, 228)), SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)), events.append)
    core._drain_inbox(block=False)
    for _ in range(20): core._step()
    torch.cuda.synchronize()
    # time the parts
    r = core.runner
    t = time.perf_counter(); n = 100
    for _ in range(n): core._step()
    torch.cuda.synchronize(); print(mode, "ms/step", 1000 * (time.perf_counter() - t) / n, flush=True)
    pr = cProfile.Profile(); pr.enable()
    for _ in range(100): core._step()
    pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:6000])
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(25); print(s.getvalue()[:6000])
    # raw graph replay
    g = r.decode_step._graphs
    key = next(iter(g._graphs))
    graph = g._graphs[key][0]
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(100): graph.replay()
    torch.cuda.synchronize(); print("replay only ms", 1000 * (time.perf_counter() - t) / 100, key, flush=True)

# ---- the same engine through its asyncio client, with the loop on its own thread ----
import asyncio
from mlxcel.engine.client import EngineClient

async def one(client, n):
    toks = []
    async for ev in client.generate(Request(f"c{time.monotonic_ns()}", list(range(300, 428)),
                                            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))):
        toks.extend(ev.token_ids)
    return toks

core.abort("a"); core._drain_inbox(block=False)
core.start()
client = EngineClient(core)
for interval in (sys.getswitchinterval(), 0.0002):
    sys.setswitchinterval(interval)
    asyncio.run(one(client, 8))
    t = time.perf_counter(); asyncio.run(one(client, 200)); dt = time.perf_counter() - t
    print(f"client path, switch interval {interval}: {1000 * dt / 200:.2f} ms/token", flush=True)
core.stop()
