"""bench/run.py's figure (d) alone, repeated and interleaved: TTFT of a 2,000-token prompt cold, then
the same prompt again (its prefix cached), through each stack's HTTP server, as run.py starts them.

    .venv/bin/python bench/prefix_ttft.py --stack new=mlxcel:src --stack base=mlxcel:/tmp/base/src \\
        --stack llama=llama-server --rounds 2

A stack is NAME=mlxcel:SRC_DIR (mlxcel from that source tree, e.g. an older commit's `git archive`)
or NAME=llama-server (run.py's binary, with -nr). Each round starts every stack in turn and sends
each of two prompts once cold and `--repeats` times cached; medians are over every round.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
from pathlib import Path

import httpx

import run as bench

EXTRA = {"ignore_eos": True}


def server_cmd(kind: str, model: Path, port: int, threads: int) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if kind.startswith("mlxcel:"):
        env["PYTHONPATH"] = str(Path(kind.split(":", 1)[1]).resolve())
        return bench.mlxcel_cmd(model, port, threads), env
    cmd = bench.llama_server_cmd(bench.LLAMA_SERVER, model, port, threads, "-nr")
    if cmd is None:
        raise SystemExit(f"no llama-server at {bench.LLAMA_SERVER}")
    return cmd, env


async def measure(base_url: str, tokenizer: bench.Tokenizer, salts: list[int],
                  repeats: int) -> tuple[list[float], list[float]]:
    cold: list[float] = []
    cached: list[float] = []
    async with httpx.AsyncClient(base_url=base_url, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        await bench.stream_completion(client, bench.prompt_text(tokenizer, 500, 999), 4, EXTRA)  # not timed
        for salt in salts:
            prompt = bench.prompt_text(tokenizer, 2000, salt)
            cold.append((await bench.stream_completion(client, prompt, 1, EXTRA))[0])
            for _ in range(repeats):
                cached.append((await bench.stream_completion(client, prompt, 1, EXTRA))[0])
    return cold, cached


def run_stack(kind: str, model: Path, tokenizer: bench.Tokenizer, threads: int, salts: list[int],
              repeats: int) -> tuple[list[float], list[float]]:
    port = bench.free_port()
    cmd, env = server_cmd(kind, model, port, threads)
    with open(bench.ROOT / "bench" / ".prefix_ttft.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            bench.wait_ready(f"http://127.0.0.1:{port}", proc)
            return asyncio.run(measure(f"http://127.0.0.1:{port}", tokenizer, salts, repeats))
        finally:
            proc.terminate()
            proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", action="append", required=True, help="NAME=mlxcel:SRC_DIR or NAME=llama-server")
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = bench.model_path(args.model)
    tokenizer = bench.Tokenizer.from_gguf(bench.GGUFFile(model).metadata)
    stacks = [s.split("=", 1) for s in args.stack]
    cold: dict[str, list[float]] = {name: [] for name, _ in stacks}
    cached: dict[str, list[float]] = {name: [] for name, _ in stacks}
    for r in range(args.rounds):
        for name, kind in stacks:
            c, h = run_stack(kind, model, tokenizer, args.threads, [3 + 10 * r, 4 + 10 * r], args.repeats)
            cold[name] += c
            cached[name] += h
            print(f"round {r} {name}: cold {[round(x, 3) for x in c]} cached {[round(x, 4) for x in h]}",
                  file=sys.stderr, flush=True)
    for name, _ in stacks:
        print(f"{name}: cached median {statistics.median(cached[name]):.4f} s (min {min(cached[name]):.4f}), "
              f"cold median {statistics.median(cold[name]):.3f} s")


if __name__ == "__main__":
    main()
