"""Cluster routing benchmark (spec X): prefix-aware routing vs Ray Serve's default, at 2 replicas.

A shared-prefix workload: a few long system prompts (together more than one replica's KV
cache holds, less than two), each asked several short questions, in a shuffled order, two
clients at a time, through the real `mlxcel cluster` entry point. Run once with
`--request-router prefix` (this project's router) and once with `--request-router pow2`
(Ray Serve's default power-of-two-choices router, unchanged), each on a fresh local Ray
cluster. Reports the prefix-cache hit rate (cached / prompt tokens, from each reply's usage)
and time to first token (streamed), and their ratios.

    .venv/bin/python bench/cluster.py --prompts 8 --questions 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

LISTENING = re.compile(r"mlxcel listening on (\S+)")
TOPICS = ("astronomy", "baking", "chess", "geology", "sailing", "opera", "beekeeping", "typography", "glaciers",
          "origami")


def system_prompt(index: int, chars: int) -> str:
    topic = TOPICS[index % len(TOPICS)]
    text = f"You are assistant number {index}, an expert on {topic}. "
    while len(text) < chars:
        text += f"When asked about {topic}, answer with one precise fact, no preamble, and stay polite. "
    return text[:chars]


def workload(num_prompts: int, num_questions: int, chars: int, seed: int) -> list[tuple[int, str]]:
    items = [(p, f"Question {q} about this?") for p in range(num_prompts) for q in range(num_questions)]
    random.Random(seed).shuffle(items)
    return items


def start_cluster(router: str, extra: list[str]) -> tuple[subprocess.Popen[str], str, Path]:
    temp = Path(tempfile.mkdtemp(prefix="mlxb-", dir="/tmp"))
    command = [sys.executable, "-m", "mlxcel.cli", "cluster", "--replicas", "2", "--replica-cpus", "1", "--threads",
               "1", "--no-warmup", "--port", "0", "--request-router", router, "--ray-temp-dir", str(temp / "ray"),
               *extra]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                               start_new_session=True)
    assert process.stderr is not None
    for line in process.stderr:
        match = LISTENING.search(line)
        if match:  # keep draining its log, or a full pipe would stall the cluster
            threading.Thread(target=lambda: [None for _ in process.stderr], daemon=True).start()  # type: ignore[union-attr]
            return process, match.group(1), temp
    raise RuntimeError(f"the {router} cluster did not start (exit {process.wait()})")


def stop_cluster(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=90)
    except subprocess.TimeoutExpired:
        process.kill()
    for entry in Path("/proc").iterdir():  # anything of its session still alive: stop it by pid
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3]) == process.pid:
                    os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue


def ask(client: httpx.Client, system: str, question: str) -> tuple[float, int, int]:
    """One streamed chat request: (time to first token, prompt tokens, cached tokens)."""
    body = {"model": "m", "temperature": 0, "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    start, ttft, usage = time.perf_counter(), None, None
    with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"] and (chunk["choices"][0]["delta"].get("content")
                                                       or chunk["choices"][0]["finish_reason"]):
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    assert ttft is not None and usage is not None
    return ttft, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def run_policy(router: str, args: argparse.Namespace) -> dict[str, float]:
    process, address, temp = start_cluster(router, ["-c", str(args.ctx_size), "-np", "2", "--metrics"])
    try:
        prompts = [system_prompt(i, args.chars) for i in range(args.prompts)]
        items = workload(args.prompts, args.questions, args.chars, args.seed)
        with httpx.Client(base_url=address, timeout=300) as client, ThreadPoolExecutor(args.clients) as pool:
            results = list(pool.map(lambda item: ask(client, prompts[item[0]], item[1]), items))
            routed = [line for line in client.get("/metrics").text.splitlines()
                      if line.startswith("mlxcel_cluster_routed_total") and 'reason="pinned"' not in line]
    finally:
        stop_cluster(process)
    ttfts = [r[0] for r in results]
    summary = {"hit_rate": sum(r[2] for r in results) / sum(r[1] for r in results),
               "ttft_mean_s": statistics.mean(ttfts), "ttft_median_s": statistics.median(ttfts),
               "requests": len(results)}
    print(f"{router}: {json.dumps(summary)}\n  " + "\n  ".join(routed), flush=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="distinct system prompts")
    parser.add_argument("--questions", type=int, default=4, help="requests per system prompt")
    parser.add_argument("--chars", type=int, default=1100, help="characters per system prompt (~4 per token)")
    parser.add_argument("--clients", type=int, default=2, help="requests in flight at once")
    parser.add_argument("--ctx-size", type=int, default=2048, help="-c per replica (its KV cache size)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("MLXCEL_NO_COMPILE", "1")  # a compiled decode step costs minutes at startup here
    prefix, pow2 = run_policy("prefix", args), run_policy("pow2", args)
    print(f"cache-hit rate: prefix {prefix['hit_rate']:.3f} vs pow2 {pow2['hit_rate']:.3f} "
          f"({prefix['hit_rate'] / max(pow2['hit_rate'], 1e-9):.2f}x)")
    for name in ("ttft_mean_s", "ttft_median_s"):
        print(f"{name}: prefix {prefix[name]:.3f} vs pow2 {pow2[name]:.3f} (pow2 / prefix "
              f"{pow2[name] / prefix[name]:.2f}x)")


if __name__ == "__main__":
    main()
