"""Issue 25 point 2: the API process's CPU time per streamed token, on the real server (CPU).

    .venv/bin/python bench/api_cost.py [--streams 64] [--rounds 3] [--route completions|chat]
    PYTHONPATH=OTHER/src .venv/bin/python bench/api_cost.py      # another tree, for a before/after figure

`mlxcel serve` with its engine core in a child process (`--engine-process on`) over a tiny random Llama
(SmolLM2's tokenizer and vocabulary, 2 layers of width 64: the engine costs little, so the API process's work
per token shows), `--streams` sampled streams (temperature 0.8, top_p 0.95, ignore_eos) of 128 tokens each,
`--rounds` times after one warm round. Reported per round: the API process's CPU microseconds (user + system,
from /proc) per generated token, and the aggregate tok/s. On 2 shared cores only the CPU time is a figure; run
the trees alternately and repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import free_port, wait_ready  # noqa: E402

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=49152, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=True)
GEN = 128


def tiny_checkpoint(folder: Path) -> Path:
    from gpu_check import random_checkpoint
    from gpu_serving import export_tokenizer

    random_checkpoint(folder, TINY)
    export_tokenizer(folder)
    return folder


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def stream(client: httpx.AsyncClient, index: int, route: str) -> int:
    """One sampled stream; its completion tokens from the usage chunk."""
    sampled = {"max_tokens": GEN, "stream": True, "ignore_eos": True, "temperature": 0.8, "top_p": 0.95,
               "stream_options": {"include_usage": True}}
    if route == "chat":
        url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"hello {index}"}], **sampled}
    else:
        url, body = "/v1/completions", {"prompt": [100 + index] * 16, **sampled}
    tokens = 0
    async with client.stream("POST", url, json=body, timeout=600) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens


async def measure(base: str, pid: int, streams: int, rounds: int, route: str) -> list[tuple[float, float]]:
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=base, limits=limits) as client:
        await asyncio.gather(*(stream(client, i, route) for i in range(streams)))  # warm, not counted
        figures = []
        for _ in range(rounds):
            before, started = cpu_seconds(pid), time.perf_counter()
            counts = await asyncio.gather(*(stream(client, i, route) for i in range(streams)))
            used, wall = cpu_seconds(pid) - before, time.perf_counter() - started
            figures.append((used / sum(counts) * 1e6, sum(counts) / wall))
        return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--route", choices=("completions", "chat"), default="completions")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_checkpoint(Path(tmp) / "tiny")
        port = free_port()
        command = [sys.executable, "-m", "mlxcel.cli", "serve", "-m", str(model), "--port", str(port),
                   "--n-parallel", str(args.streams), "--ctx-size", str(args.streams * 256), "--engine-process", "on",
                   "--max-queue-depth", str(args.streams)]
        with open(Path(tmp) / "server.log", "w") as log:
            server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            try:
                base = f"http://127.0.0.1:{port}"
                wait_ready(base, server)
                figures = asyncio.run(measure(base, server.pid, args.streams, args.rounds, args.route))
            finally:
                server.terminate()
                server.wait(60)
    print(json.dumps({"streams": args.streams, "route": args.route,
                      "api_us_per_token": [round(us, 1) for us, _ in figures],
                      "tok_s": [round(rate) for _, rate in figures]}))


if __name__ == "__main__":
    main()
