"""Serving throughput by request shape, on the lent GPU (issue 25; see bench/RESULTS.md):

    python3 bench/gpu_serving.py --export-tokenizer DIR            # here: SmolLM2's tokenizer as HF files
    PYTHONPATH=src python3 bench/gpu_serving.py --tokenizer DIR [--shapes smol,qwen15] [--widths 1,16,64,256]

For each random-weight model shape (SmolLM2's, Qwen2.5-1.5B's; bfloat16, CUDA graphs) and each
request shape — greedy, sampled (temperature 0.8, top_p 0.95), temperature 1, greedy with
logprobs, all with ignore_eos, and plain greedy — the aggregate tok/s of 128-token generations
after 128-token prompts, measured twice in one run: the engine alone (its asyncio client in this
process) and the real HTTP server (`mlxcel serve`, streaming /v1/completions, read by client
processes so that the reader is never the limit). `--profile-width N` records the server under N
streams with py-spy (`--profile-out FILE`), when py-spy is installed. `--engine-process on,off` measures
the server with its engine core in a child process and in-process, one after the other (issue 25).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {"smol": ("llama", "SMOL_SHAPE"), "qwen15": ("qwen2", "QWEN15_SHAPE")}
MODES = {  # request fields of each shape; ignore_eos keeps every stream generating the full length
    "greedy": {"temperature": 0.0, "ignore_eos": True},
    "sampled": {"temperature": 0.8, "top_p": 0.95, "ignore_eos": True},
    "temp1": {"temperature": 1.0, "ignore_eos": True},
    "logprobs": {"temperature": 0.0, "logprobs": 1, "ignore_eos": True},
    "greedy-plain": {"temperature": 0.0},
}
PROMPT_LEN, GEN = 128, 128
CLIENT_PROCESSES = 8
DEVICE = "cuda"  # --device cpu: a smoke run of this script
DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float32}
DECODE_STEP = {"cuda": "cuda-graph", "cpu": "eager"}


def export_tokenizer(out: Path) -> None:
    """SmolLM2's tokenizer (from the packaged GGUF) as tokenizer.json + tokenizer_config.json."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from mlxcel.loading.gguf import GGUFFile
    from mlxcel.text.gguf_vocab import build_backend
    from tests.conftest import smollm2_gguf

    metadata = GGUFFile(smollm2_gguf()).metadata
    out.mkdir(parents=True, exist_ok=True)
    build_backend(metadata).save(str(out / "tokenizer.json"))
    tokens = metadata["tokenizer.ggml.tokens"]
    config = {"bos_token": tokens[metadata["tokenizer.ggml.bos_token_id"]],
              "eos_token": tokens[metadata["tokenizer.ggml.eos_token_id"]],
              "chat_template": metadata["tokenizer.chat_template"]}
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def checkpoint(shape: str, tokenizer: Path, logit_scale: float) -> Path:
    import gpu_check
    from safetensors.torch import load_file, save_file

    family, name = SHAPES[shape]
    folder = gpu_check.random_checkpoint(Path(f"/tmp/{shape}-random"), getattr(gpu_check, name), family=family)
    for file in tokenizer.iterdir():
        shutil.copy(file, folder / file.name)
    # Random weights give near-uniform next-token distributions (top_p 0.95 keeps most of the
    # vocabulary), which no trained model does: the final norm's gain spreads the logits instead
    # (x10 on the SmolLM2 shape: the best token holds 0.57 on average, top_p 0.95 keeps about 12).
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * logit_scale
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def prompts(width: int, vocab: int, mode: str) -> list[list[int]]:
    """Fresh prompts for each run: no run finds another's prefix in the cache."""
    g = torch.Generator().manual_seed(width * 100 + list(MODES).index(mode))
    return [torch.randint(100, min(vocab, 40000), (PROMPT_LEN,), generator=g).tolist() for _ in range(width)]


# ---- the engine alone ----

def engine_figures(path: Path, widths: list[int], ubatch: int) -> dict:
    from mlxcel.config import EngineConfig
    from mlxcel.engine.client import EngineClient
    from mlxcel.engine.loop import EngineCore, ModelShape
    from mlxcel.layers.quant import fuse_projections
    from mlxcel.loading import load_model
    from mlxcel.text.tokenizer import Tokenizer

    loaded = load_model(path, device=DEVICE, dtype=DTYPE[DEVICE])
    fuse_projections(loaded.model)
    slots = max(widths)
    # the server's own settings: its default token budget a step, CUDA graphs on a GPU
    config = EngineConfig(max_num_seqs=slots, ctx_size=slots * 512, decode_step=DECODE_STEP[DEVICE],
                          **({"max_num_prefill_tokens": ubatch} if ubatch else {}))
    eos = Tokenizer.from_pretrained_dir(path).eos_token_ids
    core = EngineCore(loaded.model, ModelShape.of(loaded.model.args), config, eos_token_ids=eos,
                      device=DEVICE, dtype=DTYPE[DEVICE])
    core.warm_decode_step()
    core.start()
    client = EngineClient(core)
    out: dict = {}
    try:
        for mode, fields in MODES.items():
            for width in widths:
                out[f"{mode}@{width}"] = asyncio.run(engine_run(client, prompts(width, loaded.model.args.vocab_size, mode), fields))
                print(f"engine {mode}@{width}: {out[f'{mode}@{width}']} tok/s", flush=True)
    finally:
        core.stop()
    del loaded, core
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


async def engine_run(client, batch: list[list[int]], fields: dict) -> float:  # noqa: ANN001
    from mlxcel.types import Request, SamplingParams

    async def one(i: int, p: list[int], max_tokens: int) -> int:
        n = 0
        params = SamplingParams(max_tokens=max_tokens, **fields)
        async for event in client.generate(Request(f"e{i}-{time.monotonic_ns()}", p, params)):
            n += len(event.token_ids)
        return n
    # warm: the same batch, short (first-use kernels and prefill shapes are not measured)
    await asyncio.gather(*(one(i, p[::-1], 8) for i, p in enumerate(batch)))
    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p, GEN) for i, p in enumerate(batch)))
    return round(sum(counts) / (time.perf_counter() - start), 1)


# ---- the real HTTP server ----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(path: Path, slots: int, log: Path, engine_process: str, ubatch: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "mlxcel.cli", "serve", "-m", str(path), "--device", DEVICE, "--port", str(port),
           "--n-parallel", str(slots), "--ctx-size", str(slots * 512), "--max-queue-depth", str(slots),
           "--engine-process", engine_process, *(["--ubatch-size", str(ubatch)] if ubatch else [])]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not become ready")


def client_share(args: tuple[str, list[list[int]], dict, float, int]) -> tuple[int, float, float]:
    """One client process: stream its prompts at once, from `start_at`; (tokens, first start, last end)."""
    base, batch, fields, start_at, max_tokens = args
    import httpx

    async def one(client: httpx.AsyncClient, p: list[int]) -> int:
        body = {"prompt": p, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                **fields}
        n = 0
        async with client.stream("POST", "/v1/completions", json=body, timeout=600) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {") and '"usage"' in line:
                    usage = json.loads(line[6:]).get("usage")
                    n = usage["completion_tokens"] if usage else n
        return n

    async def all_of_them() -> list[int]:
        limits = httpx.Limits(max_connections=len(batch) + 4)
        async with httpx.AsyncClient(base_url=base, limits=limits) as client:
            await asyncio.sleep(max(start_at - time.time(), 0))
            return await asyncio.gather(*(one(client, p) for p in batch))

    started = time.time()
    counts = asyncio.run(all_of_them())
    return sum(counts), max(started, start_at), time.time()


def server_run(pool, base: str, batch: list[list[int]], fields: dict) -> float:  # noqa: ANN001
    shares = [batch[i::CLIENT_PROCESSES] for i in range(CLIENT_PROCESSES)]
    pool.map(client_share, [(base, [p[::-1] for p in s], fields, 0.0, 8) for s in shares if s])  # warm, as above
    start_at = time.time() + 1.0
    results = pool.map(client_share, [(base, s, fields, start_at, GEN) for s in shares if s])
    tokens = sum(r[0] for r in results)
    return round(tokens / (max(r[2] for r in results) - start_at), 1)


def server_figures(path: Path, widths: list[int], vocab: int, profile_width: int, profile_out: Path | None,
                   engine_process: str = "auto", ubatch: int = 0) -> dict:
    proc, base = start_server(path, max(widths), Path(f"/tmp/gpu_serving_server_{engine_process}.log"), engine_process,
                              ubatch)
    out: dict = {}
    try:
        with multiprocessing.get_context("spawn").Pool(CLIENT_PROCESSES) as pool:
            for mode, fields in MODES.items():
                for width in widths:
                    out[f"{mode}@{width}"] = server_run(pool, base, prompts(width, vocab, mode), fields)
                    print(f"server[engine-process {engine_process}] {mode}@{width}: {out[f'{mode}@{width}']} tok/s",
                          flush=True)
            if profile_width and profile_out and shutil.which("py-spy"):
                spy = subprocess.Popen(["py-spy", "record", "--pid", str(proc.pid), "--duration", "8", "--rate", "200",
                                        "--format", "raw", "--output", str(profile_out.with_suffix(f".{engine_process}"
                                                                                               f"{profile_out.suffix}")),
                                        "--threads", "--nonblocking", "--subprocesses"])
                for mode in MODES:  # the modes measured (--modes), under the profiler
                    server_run(pool, base, prompts(profile_width, vocab, mode), MODES[mode])
                spy.wait(60)
    finally:
        stop = time.monotonic()
        proc.terminate()  # SIGTERM: the server drains and exits
        proc.wait(150)
        out["shutdown_s"] = round(time.monotonic() - stop, 1)
        print(f"server[engine-process {engine_process}] exited {proc.returncode} {out['shutdown_s']} s after SIGTERM",
              flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export-tokenizer", type=Path, help="write SmolLM2's tokenizer files to this folder and exit")
    parser.add_argument("--tokenizer", type=Path, help="folder of tokenizer files for the random checkpoints")
    parser.add_argument("--shapes", default="smol,qwen15")
    parser.add_argument("--widths", default="1,16,64,256")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--no-server", action="store_true")
    parser.add_argument("--logit-scale", type=float, default=10.0,
                        help="gain on the random model's final norm, so its logits spread like a trained model's (1: flat)")
    parser.add_argument("--profile-width", type=int, default=0)
    parser.add_argument("--profile-out", type=Path)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run of the script")
    parser.add_argument("--engine-process", default="auto",
                        help="the server's --engine-process values to measure, comma-separated (e.g. on,off: both, one "
                             "after the other, each its own server)")
    parser.add_argument("--ubatch", type=int, default=0,
                        help="prompt tokens a step (--ubatch-size) for the engine and the servers; 0: the default")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.export_tokenizer:
        export_tokenizer(args.export_tokenizer)
        return
    for name in set(MODES) - set(args.modes.split(",")):
        MODES.pop(name)
    widths = [int(w) for w in args.widths.split(",")]
    report: dict = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "prompt": PROMPT_LEN, "gen": GEN,
                    "logit_scale": args.logit_scale}
    for shape in args.shapes.split(","):
        path = checkpoint(shape, args.tokenizer, args.logit_scale)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        report[shape] = {"engine": engine_figures(path, widths, args.ubatch)}
        for engine_process in [] if args.no_server else args.engine_process.split(","):
            key = "server" if engine_process == "auto" else f"server[engine-process {engine_process}]"
            report[shape][key] = server_figures(path, widths, vocab, args.profile_width if shape == "smol" else 0,
                                                args.profile_out, engine_process, args.ubatch)
    text = json.dumps(report, indent=1)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_serving.json").write_text(text)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    main()
