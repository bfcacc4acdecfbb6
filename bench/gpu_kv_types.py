"""The quantized KV caches on the lent GPU (issue 11 / N2): q8_0 and turbo4 through CUDA graphs.

    PYTHONPATH=src python3 bench/gpu_kv_types.py

A random-weight SmolLM2-shaped model in bfloat16; for each cache type, an engine with captured
decode steps greedy-decodes 64 tokens for 4 random prompts at once; prints, per type, the decode
speed, the KV bytes a token, and how many leading tokens equal the bf16 cache's. Prints JSON.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from gpu_check import engine_runs, random_checkpoint  # noqa: E402

from mlxcel.config import EngineConfig  # noqa: E402
from mlxcel.engine.client import EngineClient  # noqa: E402
from mlxcel.engine.loop import EngineCore, ModelShape  # noqa: E402
from mlxcel.layers.quant import fuse_projections  # noqa: E402
from mlxcel.loading import load_model  # noqa: E402

SETTINGS = {"bf16": {}, "q8_0": {"cache_type_k": "q8_0", "cache_type_v": "q8_0"}, "turbo4": {"kv_cache_mode": "turbo4"}}


def main() -> None:
    loaded = load_model(random_checkpoint(Path("/tmp/smol-random")), device="cuda", dtype=torch.bfloat16)
    fuse_projections(loaded.model)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (40, 130, 300, 77)]
    report, reference = {}, None
    for name, settings in SETTINGS.items():
        config = EngineConfig(max_num_seqs=4, ctx_size=4096, decode_step="cuda-graph", **settings)
        core = EngineCore(loaded.model, ModelShape.of(loaded.model.args), config, eos_token_ids=frozenset(),
                          device="cuda", dtype=torch.bfloat16)
        core.warm_decode_step()
        core.start()
        client = EngineClient(core)
        asyncio.run(engine_runs(client, prompts, 4))
        started = time.perf_counter()
        outs = asyncio.run(engine_runs(client, prompts, 64))
        elapsed = time.perf_counter() - started
        core.stop()
        reference = reference or outs
        same = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(o)) for o, r in zip(outs, reference)]
        report[name] = {"tok_s_4_rows": round(sum(map(len, outs)) / elapsed, 1),
                        "kv_bytes_per_token": core.kv_cache.bytes_per_token, "leading_tokens_equal_bf16": same}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
