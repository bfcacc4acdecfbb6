"""Issue 29's restart figure: TTFT of a long prompt cold, then after a server restart with the prefix
cache's disk tier on (the same prompt plus a new question), and the greedy stream after restart.

    .venv/bin/python bench/prefix_disk_restart.py [--model PATH] [--tokens 4000] [--threads 2]

Three mlxcel servers in turn on one --prefix-cache-dir (a fresh temp folder): A answers the prompt
cold and stops (SIGTERM: its cached blocks go to disk); B answers prompt + question (its prefix from
disk); C answers the prompt alone again, whose greedy tokens must equal A's. Also printed: the disk
tier's size, blocks read and load time, and the crossover's two rates (load per block from B's
counters, prefill per token from A's cold TTFT).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

import run as bench

QUESTION = "\n\nIn one sentence: what is the text above about?"


def server_cmd(model: Path, port: int, threads: int, folder: Path, num_tokens: int) -> list[str]:
    return [sys.executable, "-m", "mlxcel.cli", "serve", "-m", str(model), "--port", str(port),
            "--threads", str(threads), "--n-parallel", "1", "--ctx-size", str(num_tokens + 600),
            "--prefix-cache-dir", str(folder), "--prefix-cache-disk-size", "20G"]


async def completion(base_url: str, prompt: str, max_tokens: int) -> tuple[float, str]:
    """Streamed greedy completion: (time to first token, the text)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=900) as client:
        ttft, _, _ = await bench.stream_completion(client, prompt, 1, {})  # TTFT alone: one token
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        text = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
    return ttft, text


def with_server(model: Path, threads: int, folder: Path, num_tokens: int, prompt: str,
                max_tokens: int) -> tuple[float, str, dict]:
    port = bench.free_port()
    env = {**os.environ, "PYTHONPATH": str(bench.ROOT / "src")}
    with open(folder.parent / f"server-{port}.log", "w") as log:
        proc = subprocess.Popen(server_cmd(model, port, threads, folder, num_tokens), stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        try:
            base = f"http://127.0.0.1:{port}"
            bench.wait_ready(base, proc)
            ttft, text = asyncio.run(completion(base, prompt, max_tokens))
            disk = httpx.get(base + "/v1/cache/stats").json()["disk"]
        finally:
            proc.send_signal(signal.SIGTERM)  # graceful: the disk tier saves every cached block
            proc.wait(300)
    return ttft, text, disk


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.kvb"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    model = bench.model_path(args.model)
    tokenizer = bench.Tokenizer.from_gguf(bench.GGUFFile(model).metadata)
    prompt = bench.prompt_text(tokenizer, args.tokens, 29)
    with tempfile.TemporaryDirectory(prefix="mlxcel-disk-bench-") as tmp:
        folder = Path(tmp) / "prefix-cache"
        cold, cold_text, _ = with_server(model, args.threads, folder, args.tokens, prompt, args.max_tokens)
        size = folder_bytes(folder)
        warm, _, disk = with_server(model, args.threads, folder, args.tokens, prompt + QUESTION, args.max_tokens)
        again, again_text, _ = with_server(model, args.threads, folder, args.tokens, prompt, args.max_tokens)
    load_per_block = disk["load_seconds"] / max(disk["blocks_read"], 1)
    print(f"model {model.name}, {args.tokens}-token prompt, {args.threads} threads")
    print(f"TTFT cold: {cold * 1000:.0f} ms")
    print(f"TTFT after restart, prompt + new question: {warm * 1000:.0f} ms ({100 * warm / cold:.1f} % of cold)")
    print(f"TTFT after restart, same prompt: {again * 1000:.0f} ms")
    print(f"greedy {args.max_tokens} tokens after restart identical: {again_text == cold_text}")
    print(f"disk tier: {size / 2**20:.1f} MiB for the prompt; restart read {disk['blocks_read']} blocks "
          f"({disk['bytes_read'] / 2**20:.1f} MiB) in {disk['load_seconds'] * 1000:.0f} ms")
    print(f"crossover: load {load_per_block * 1e3:.3f} ms a block vs prefill {cold / args.tokens * 16 * 1e3:.2f} ms "
          "a block (16 tokens, from the cold TTFT)")


if __name__ == "__main__":
    main()
