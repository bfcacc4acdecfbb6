"""Issue 29 point 5: what the host-memory tier of the prefix cache buys on a GPU (see bench/RESULTS.md).

    PYTHONPATH=src python3 bench/prefix_host_tier.py [--tokenizer DIR] [--shapes smol,qwen15] [--tokens 8000,32000]
    PYTHONPATH=src python3 bench/prefix_host_tier.py --device cpu --shapes tiny --tokens 600   # a smoke run

For each random-weight model shape (SmolLM2's, Qwen2.5-1.5B's, as bench/gpu_serving.py builds them; bfloat16,
CUDA graphs) and each prompt length it fits, one engine in this process (no server, no network) answers the
same random-token prompt five ways and reports the time to the first token of each: a warm-up, cold (nothing
cached), a device hit (blocks still in the KV pool), a host hit (every cached block evicted from the pool
into the host tier's pinned rows, then copied back) and a disk hit (the host tier spilled to the disk tier,
then read back). Also: the greedy tokens of each hit against the device hit's (restored blocks must give
the computed tokens), the engine-thread time of the evictions and the time until their device-to-host copies
finished, and the raw host<->device copy rates, pinned and pageable. About 2 minutes on an H200 with the
defaults (most of it building the Qwen checkpoint once and the cold 32k prefills).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {"smol": ("llama", "SMOL_SHAPE"), "qwen15": ("qwen2", "QWEN15_SHAPE"), "tiny": ("llama", None)}
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=2048, max_position_embeddings=4096, rope_theta=10000.0,
                  rms_norm_eps=1e-5, tie_word_embeddings=True)
DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float32}
DECODE_STEP = {"cuda": "cuda-graph", "cpu": "eager"}
NUM_OUTPUT = 8  # greedy tokens compared across the tiers


def checkpoint(shape: str, tokenizer: Path | None) -> Path:
    """The shape's random checkpoint under /tmp, built once (reused by a later run on the same machine)."""
    import gpu_check

    family, name = SHAPES[shape]
    folder = Path(f"/tmp/{shape}-random-host-tier")
    if not (folder / "model.safetensors").exists():
        gpu_check.random_checkpoint(folder, getattr(gpu_check, name) if name else TINY_SHAPE, family=family)
    if tokenizer is not None:
        for file in tokenizer.iterdir():
            shutil.copy(file, folder / file.name)
    return folder


def copy_rates(device: str, num_bytes: int = 1 << 30) -> dict:
    """GB/s of host->device and device->host copies of `num_bytes`, pinned and pageable (CUDA only)."""
    if device != "cuda":
        return {}
    target = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    out = {}
    for kind, pinned in (("pinned", True), ("pageable", False)):
        host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pinned)
        for direction, (dst, src) in (("h2d", (target, host)), ("d2h", (host, target))):
            dst.copy_(src, non_blocking=pinned)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(3):
                dst.copy_(src, non_blocking=pinned)
            torch.cuda.synchronize()
            out[f"{direction}_{kind}_GBps"] = round(3 * num_bytes / (time.perf_counter() - start) / 1e9, 1)
    return out


async def first_token(client, request_id: str, tokens: list[int]) -> tuple[float, list[int], int]:  # noqa: ANN001
    """(seconds to the first token, the greedy tokens, prompt tokens served from the cache)."""
    from mlxcel.types import Request, SamplingParams

    params = SamplingParams(max_tokens=NUM_OUTPUT, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    ttft, out, cached = 0.0, [], 0
    async for event in client.generate(Request(request_id, tokens, params)):
        if event.token_ids and not out:
            ttft = time.perf_counter() - start
        out += list(event.token_ids)
        cached = event.num_cached_tokens
    return ttft, out, cached


def evict_all(core) -> tuple[float, float]:  # noqa: ANN001
    """On the engine thread: every cached block leaves the KV pool (into the host tier); the engine-thread
    seconds, and the seconds until the device-to-host copies had run."""
    pool = core.kv.pool
    start = time.perf_counter()
    pool.free(pool.allocate(pool.num_free_blocks))
    pool.flush_evictions()  # as the engine does before a step: the tiers gather and copy what was evicted
    issued = time.perf_counter() - start
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return issued, time.perf_counter() - start


def spill_to_disk(core) -> int:  # noqa: ANN001
    """On the engine thread: the host tier's blocks handed to the disk tier's writer; how many."""
    num = core.host.stats().num_blocks
    core.host.close()
    return num


def run_shape(shape: str, lengths: list[int], device: str, tokenizer: Path | None, folder: Path) -> list[dict]:
    from mlxcel.config import EngineConfig
    from mlxcel.engine.client import EngineClient
    from mlxcel.engine.loop import EngineCore, ModelShape
    from mlxcel.layers.quant import fuse_projections
    from mlxcel.loading import load_model

    path = checkpoint(shape, tokenizer)
    loaded = load_model(path, device=device, dtype=DTYPE[device])
    fuse_projections(loaded.model)
    args = loaded.model.args
    lengths = [n for n in lengths if n + NUM_OUTPUT + 16 <= args.max_position_embeddings]
    if not lengths:
        return []
    most = max(lengths) + NUM_OUTPUT + 16
    # one slot with room for twice the longest prompt: the device hit is a real hit, evictions are explicit
    config = EngineConfig(max_num_seqs=1, ctx_size=2 * most, max_num_batched_tokens=2048,
                          decode_step=DECODE_STEP[device], prefix_cache_dir=str(folder / shape),
                          prefix_cache_disk_bytes=64 << 30, prefix_cache_host_bytes=16 << 30)
    core = EngineCore(loaded.model, ModelShape.of(args), config, eos_token_ids=frozenset(), device=device,
                      dtype=DTYPE[device], cache_identity=f"bench-{shape}")
    assert core.host is not None and core.disk is not None
    core.warm_decode_step()
    core.start()
    client = EngineClient(core)
    rows = []
    try:
        for length in lengths:
            rows.append(asyncio.run(measure(core, client, shape, length, args.vocab_size)))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        core.stop()
    del loaded, core
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


async def measure(core, client, shape: str, length: int, vocab: int) -> dict:  # noqa: ANN001
    g = torch.Generator().manual_seed(length)
    prompt, warm = (torch.randint(100, vocab - 1, (length,), generator=g).tolist() for _ in range(2))
    await first_token(client, f"warm{length}", warm)  # first-use kernels and prefill shapes
    await client.reset_prefix_cache()
    row: dict = {"shape": shape, "prompt_tokens": length}
    ttft, cold, _ = await first_token(client, f"cold{length}", prompt)
    row["cold_s"] = round(ttft, 4)
    ttft, device_out, cached = await first_token(client, f"device{length}", prompt)
    row |= {"device_hit_s": round(ttft, 4), "device_cached": cached}
    before = core.host.stats()
    issued, copied = await client.call(lambda: evict_all(core))
    stored = core.host.stats().num_bytes_stored - before.num_bytes_stored
    row |= {"evict_engine_s": round(issued, 4), "evict_copied_s": round(copied, 4), "evicted_bytes": stored}
    ttft, host_out, cached = await first_token(client, f"host{length}", prompt)
    after = core.host.stats()
    row |= {"host_hit_s": round(ttft, 4), "host_cached": cached,
            "host_load_engine_s": round(after.load_seconds - before.load_seconds, 4),
            "host_loaded_bytes": after.num_bytes_loaded - before.num_bytes_loaded}
    await client.call(lambda: evict_all(core))
    written = core.disk.stats().num_blocks_written
    num_spilled = await client.call(lambda: spill_to_disk(core))
    deadline = time.monotonic() + 120
    while core.disk.stats().num_blocks_written < written + num_spilled and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    disk_before = core.disk.stats()
    ttft, disk_out, cached = await first_token(client, f"disk{length}", prompt)
    disk = core.disk.stats()
    row |= {"disk_hit_s": round(ttft, 4), "disk_cached": cached,
            "disk_load_s": round(disk.load_seconds - disk_before.load_seconds, 4),
            "disk_read_bytes": disk.num_bytes_read - disk_before.num_bytes_read,
            "host_same_as_device": host_out == device_out, "disk_same_as_device": disk_out == device_out,
            "device_same_as_cold": device_out == cold}
    if row["host_load_engine_s"] > 0:
        row["host_load_GBps_engine"] = round(row["host_loaded_bytes"] / row["host_load_engine_s"] / 1e9, 2)
    if row["evict_copied_s"] > 0:
        row["evict_GBps"] = round(stored / row["evict_copied_s"] / 1e9, 2)
    await client.reset_prefix_cache()  # the next length starts cold, its files gone
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, help="tokenizer files copied into the checkpoints "
                        "(bench/gpu_serving.py --export-tokenizer DIR); the engine itself needs none")
    parser.add_argument("--shapes", default="smol,qwen15")
    parser.add_argument("--tokens", default="8000,32000", help="prompt lengths (each shape runs those it fits)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here too")
    options = parser.parse_args()
    device = options.device
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "torch": torch.__version__, "copy_rates": copy_rates(device), "rows": []}
    print(json.dumps(result["copy_rates"]), flush=True)
    lengths = [int(n) for n in options.tokens.split(",")]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mlxcel-host-tier-") as folder:
        for shape in options.shapes.split(","):
            result["rows"] += run_shape(shape, lengths, device, options.tokenizer, Path(folder))
            print(f"{shape} done at {time.perf_counter() - started:.0f} s", flush=True)
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    text = json.dumps(result, indent=1)
    print(text)
    if options.out:
        options.out.write_text(text)


if __name__ == "__main__":
    main()
