"""mlxcel and llama.cpp's llama-server side by side on the same GGUF, through HTTP (issue 45; bench/RESULTS.md):

    bench/gpu_llama_src.sh GIT_DIR .gpu/llama-src.tar.xz              # here: llama.cpp's source, trimmed
    bench/gpu_llama_server_build.sh .gpu/llama-src.tar.xz /tmp/ls cuda  # there: llama-server with CUDA
    PYTHONPATH=src python3 bench/gpu_side_by_side.py --llama-server /tmp/ls/build/bin/llama-server \\
        --gguf smol=SmolLM2-135M-Instruct.Q4_1.gguf --random-qwen15 --llama-src /tmp/ls/src --tokenizer DIR

Each GGUF is served by each server in turn, alone on the machine, with the same slots and context (`--n-parallel` /
`-np` = the widest run, 512 tokens of context a slot). Per server: startup (process start to /health 200), the
peak memory it adds to the device (nvidia-smi's memory.used over its idle reading, polled every 0.2 s; on the CPU the
server's resident set), and for each request shape (greedy, sampled at 0.8 / 0.95, greedy with logprobs=1; all with
ignore_eos) and each number of streams: the aggregate generated tok/s (tokens over first send to last byte) and the
median time to first token, of fresh 128-token prompts (token ids, so both servers see the same input) generating
128 tokens each through streaming /v1/completions. A warm run of the same batch (reversed prompts, 8 tokens) comes
first, so first-use kernels and graph capture stay out of the figures.

`--random-qwen15`: a random-weight model of Qwen2.5-1.5B's shape (transformers' Qwen2 with random weights, SmolLM2's
tokenizer, vocabulary padded to 151,936, final norm x10 so that its logits spread as a trained model's), converted by llama.cpp's own convert_hf_to_gguf.py (`--outtype`). The
converter picks the vocabulary's pre-tokenizer by hashing a tokenization through transformers' AutoTokenizer, which
in transformers 5 loads Qwen2Tokenizer for a qwen2 config whatever tokenizer.json says, and so gives an unknown hash;
the conversion runs with AutoTokenizer as the plain tokenizer.json backend (`convert_with_plain_tokenizer`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_serving import free_port  # noqa: E402

MODES = {  # request fields of each shape; ignore_eos keeps every stream generating the full length
    "greedy": {"temperature": 0.0, "ignore_eos": True},
    "sampled": {"temperature": 0.8, "top_p": 0.95, "ignore_eos": True},
    "logprobs": {"temperature": 0.0, "logprobs": 1, "ignore_eos": True},
}
PROMPT_LEN, GEN = 128, 128
CTX_PER_SLOT = 512
CLIENT_PROCESSES = 8
QWEN15 = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
              intermediate_size=8960, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
              rms_norm_eps=1e-6, tie_word_embeddings=True)
SMOKE_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=49152, max_position_embeddings=4096, tie_word_embeddings=True)
LOGIT_SCALE = 10.0
PROBE = "The capital of France is"  # one greedy text request per server: do both continue it alike?


# ---- the random 1.5B GGUF, through llama.cpp's converter ----

def random_qwen2_folder(folder: Path, shape: dict, tokenizer: Path, device: str) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):  # 1.5B random weights: drawn on the GPU in seconds, on the CPU in minutes
        model = Qwen2ForCausalLM(Qwen2Config(**shape)).to(torch.bfloat16)
        # Random weights give near-uniform next-token distributions; the final norm's gain spreads the logits as a
        # trained model's are (bench/gpu_serving.py's --logit-scale 10), so top_p keeps a few tokens, not the vocabulary
        model.model.norm.weight.data.mul_(LOGIT_SCALE)
    model.save_pretrained(folder, safe_serialization=True)
    for file in tokenizer.iterdir():
        shutil.copy(file, folder / file.name)
    del model
    return folder


def convert_with_plain_tokenizer(converter: Path, folder: Path, out: Path, outtype: str) -> None:
    """Run convert_hf_to_gguf.py with AutoTokenizer loading tokenizer.json as it is (see the module's docstring)."""
    launcher = ("import runpy, sys, transformers\n"
                "from transformers import PreTrainedTokenizerFast\n"
                "transformers.AutoTokenizer.from_pretrained = PreTrainedTokenizerFast.from_pretrained\n"
                f"sys.path.insert(0, {str(converter.parent)!r})\n"
                f"sys.argv = [{str(converter)!r}, *sys.argv[1:]]\n"
                f"runpy.run_path({str(converter)!r}, run_name='__main__')\n")
    subprocess.run([sys.executable, "-c", launcher, str(folder), "--outtype", outtype, "--outfile", str(out)],
                   check=True, stdout=subprocess.DEVNULL)


def random_gguf(work: Path, shape: dict, tokenizer: Path, llama_src: Path, outtype: str, device: str) -> Path:
    out = work / f"random-qwen2-{shape['hidden_size']}x{shape['num_hidden_layers']}-{outtype}.gguf"
    if not out.exists():
        folder = random_qwen2_folder(work / "random-qwen2-hf", shape, tokenizer, device)
        convert_with_plain_tokenizer(llama_src / "convert_hf_to_gguf.py", folder, out, outtype)
        shutil.rmtree(folder)
    return out


# ---- the servers ----

@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    base: str
    startup_s: float
    memory: MemoryWatch


def mlxcel_command(gguf: Path, port: int, slots: int, device: str) -> list[str]:
    return [sys.executable, "-m", "mlxcel.cli", "serve", "-m", str(gguf), "--device", device, "--port", str(port),
            "--host", "127.0.0.1", "--n-parallel", str(slots), "--ctx-size", str(slots * CTX_PER_SLOT),
            "--max-queue-depth", str(slots)]


def llama_command(binary: Path, gguf: Path, port: int, slots: int, device: str) -> list[str]:
    # -ngl 999: every layer on the GPU; flash attention and continuous batching are llama-server's defaults there
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
            "-c", str(slots * CTX_PER_SLOT), *(["-ngl", "999"] if device == "cuda" else ["-t", str(os.cpu_count())])]


def start(name: str, cmd: list[str], port: int, log: Path, device: str) -> Server:
    memory = MemoryWatch(device)
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    memory.start(proc.pid)
    base = f"http://127.0.0.1:{port}"
    import httpx

    while time.monotonic() - started < 600:
        if proc.poll() is not None:
            memory.stop()
            raise RuntimeError(f"{name} exited with {proc.returncode}; see {log}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return Server(name, proc, base, round(time.monotonic() - started, 1), memory)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{name} did not become ready in 600 s")


def stop(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(120)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait(30)
    server.memory.stop()


@dataclass
class MemoryWatch:
    """Peak device memory in use while a server runs, over the reading before it started (MiB)."""

    device: str
    idle_mib: float = 0.0
    peak_mib: float = 0.0
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def read(self, pid: int) -> float:
        if self.device == "cuda":
            text = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, check=True).stdout
            return float(text.split()[0])
        return tree_rss_mib(pid)

    def start(self, pid: int) -> None:
        self.idle_mib = self.read(pid) if self.device == "cuda" else 0.0
        self.peak_mib = self.idle_mib

        def poll() -> None:
            while not self._done.wait(0.2):
                try:
                    self.peak_mib = max(self.peak_mib, self.read(pid))
                except (subprocess.SubprocessError, OSError, ValueError, IndexError):
                    pass
        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread:
            self._thread.join(5)

    @property
    def added_mib(self) -> float:
        return round(self.peak_mib - self.idle_mib)


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and its children (the CPU smoke run's stand-in for device memory)."""
    pids, total = [pid], 0.0
    while pids:
        p = pids.pop()
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
            pids += [int(c) for t in Path(f"/proc/{p}/task").iterdir()
                     for c in (t / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return total


# ---- the clients ----

def prompts(width: int, mode: str, vocab: int) -> list[list[int]]:
    """Fresh token-id prompts for each run: no run finds another's prefix in either server's cache."""
    import random

    rng = random.Random(width * 100 + list(MODES).index(mode))
    return [[rng.randrange(100, min(vocab, 40000)) for _ in range(PROMPT_LEN)] for _ in range(width)]


def client_share(args: tuple[str, list[list[int]], dict, float, int]) -> list[tuple[int, float, float]]:
    """One client process: streams its prompts at once from `start_at`; per request (tokens, TTFT s, end time)."""
    base, batch, fields, start_at, max_tokens = args
    import httpx

    async def one(client: httpx.AsyncClient, p: list[int]) -> tuple[int, float, float]:
        body = {"prompt": p, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                **fields}
        chunks, usage, first = 0, None, None
        sent = time.time()
        async with client.stream("POST", "/v1/completions", json=body, timeout=600) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                # a token's chunk (finish_reason null), text or not: a random model's padded vocabulary
                # entries detokenize to nothing
                if event.get("choices") and event["choices"][0].get("finish_reason") is None:
                    first = first or time.time()
                    chunks += 1
                usage = event.get("usage") or usage
        # usage when the server sends it; else one streamed chunk a token (llama-server streams token by token)
        tokens = usage["completion_tokens"] if usage else chunks
        return tokens, (first or time.time()) - sent, time.time()

    async def all_of_them() -> list[tuple[int, float, float]]:
        limits = httpx.Limits(max_connections=len(batch) + 4)
        async with httpx.AsyncClient(base_url=base, limits=limits) as client:
            await asyncio.sleep(max(start_at - time.time(), 0))
            return list(await asyncio.gather(*(one(client, p) for p in batch)))

    return asyncio.run(all_of_them())


def run_width(pool, base: str, batch: list[list[int]], fields: dict) -> dict:  # noqa: ANN001
    shares = [s for s in (batch[i::CLIENT_PROCESSES] for i in range(CLIENT_PROCESSES)) if s]
    pool.map(client_share, [(base, [p[::-1] for p in s], fields, 0.0, 8) for s in shares])  # warm, as the docstring says
    start_at = time.time() + 1.0
    results = [r for share in pool.map(client_share, [(base, s, fields, start_at, GEN) for s in shares]) for r in share]
    tokens = sum(r[0] for r in results)
    return {"tok_s": round(tokens / (max(r[2] for r in results) - start_at), 1),
            "ttft_ms": round(statistics.median(r[1] for r in results) * 1000, 1), "tokens": tokens}


def probe(base: str) -> str:
    import httpx

    body = {"prompt": PROBE, "max_tokens": 16, "temperature": 0.0}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]


def measure(server: Server, widths: list[int], vocab: int, log: Path) -> dict:
    out: dict = {"startup_s": server.startup_s, "probe": probe(server.base)}
    with multiprocessing.get_context("spawn").Pool(CLIENT_PROCESSES) as pool:
        for mode, fields in MODES.items():
            for width in widths:
                cell = run_width(pool, server.base, prompts(width, mode, vocab), fields)
                out[f"{mode}@{width}"] = cell
                print(f"{server.name} {mode}@{width}: {cell}", flush=True)
    out["peak_memory_mib"] = server.memory.added_mib
    with log.open("a") as f:
        f.write(json.dumps({server.name: out}) + "\n")
    return out


def gguf_vocab(gguf: Path) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from mlxcel.loading.gguf import GGUFFile

    return len(GGUFFile(gguf).metadata["tokenizer.ggml.tokens"])


def table(report: dict, widths: list[int]) -> str:
    rows = ["| model | server | startup s | peak MiB | " + " | ".join(f"{m} tok/s ({'/'.join(map(str, widths))})"
                                                                 for m in MODES) + " | median TTFT ms, greedy |",
            "|---" * (5 + len(MODES)) + "|"]
    for model, servers in report["models"].items():
        for name, r in servers.items():
            if "error" in r:
                rows.append(f"| {model} | {name} | error: {r['error'][:80]!r} |")
                continue
            cells = [" / ".join(f"{r[f'{m}@{w}']['tok_s']:,.0f}" for w in widths) for m in MODES]
            ttft = " / ".join(f"{r[f'greedy@{w}']['ttft_ms']:,.0f}" for w in widths)
            rows.append(f"| {model} | {name} | {r['startup_s']} | {r['peak_memory_mib']} | " + " | ".join(cells)
                        + f" | {ttft} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", action="append", default=[], help="NAME=PATH of a GGUF to serve (repeatable)")
    parser.add_argument("--random-qwen15", action="store_true", help="also a random Qwen2.5-1.5B-shape GGUF")
    parser.add_argument("--smoke-shape", action="store_true", help="the random model at a tiny shape (CPU smoke run)")
    parser.add_argument("--prepare-only", action="store_true", help="make the random GGUF and stop")
    parser.add_argument("--outtype", default="f16", help="convert_hf_to_gguf.py's --outtype for the random model")
    parser.add_argument("--llama-src", type=Path, help="the unpacked llama.cpp source (its converter)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer files for the random model "
                                                       "(bench/gpu_serving.py --export-tokenizer)")
    parser.add_argument("--llama-server", type=Path, help="llama-server binary; none: mlxcel alone")
    parser.add_argument("--servers", default="mlxcel,llama.cpp")
    parser.add_argument("--widths", default="1,16,64,256")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--gen", type=int, default=128, help="tokens each request generates")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/side_by_side"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    args = parser.parse_args()
    global GEN
    GEN = args.gen
    for name in set(MODES) - set(args.modes.split(",")):
        MODES.pop(name)
    widths = [int(w) for w in args.widths.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    models = dict(item.split("=", 1) for item in args.gguf)
    if args.random_qwen15:
        shape = SMOKE_SHAPE if args.smoke_shape else QWEN15
        started = time.monotonic()
        models["qwen15-random"] = str(random_gguf(args.work, shape, args.tokenizer, args.llama_src, args.outtype,
                                                  args.device))
        print(f"random GGUF {models['qwen15-random']} in {time.monotonic() - started:.0f} s", flush=True)
    if args.prepare_only:
        return
    report: dict = {"device": device_name(args.device), "prompt_len": PROMPT_LEN, "gen": GEN, "file_mib": {},
                    "models": {}}
    log = args.out / "side_by_side.jsonl"
    for model, path in models.items():
        gguf = Path(path)
        vocab = gguf_vocab(gguf)
        report["file_mib"][model] = round(gguf.stat().st_size / 2**20)
        report["models"][model] = {}
        for name in args.servers.split(","):
            if name == "llama.cpp" and not args.llama_server:
                continue
            port = free_port()
            cmd = (mlxcel_command(gguf, port, max(widths), args.device) if name == "mlxcel"
                   else llama_command(args.llama_server, gguf, port, max(widths), args.device))
            try:
                server = start(name, cmd, port, args.out / f"{model}.{name}.log", args.device)
            except (RuntimeError, OSError) as error:  # one server failing leaves the others' figures
                report["models"][model][name] = {"error": str(error)}
                print(f"{model} {name}: {error}", flush=True)
                continue
            try:
                report["models"][model][name] = measure(server, widths, vocab, log)
            except Exception as error:  # noqa: BLE001 (the report names it; the next server still runs)
                report["models"][model][name] = {"error": repr(error)}
                print(f"{model} {name}: {error!r}", flush=True)
            finally:
                stop(server)
    (args.out / "side_by_side.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    print(table(report, widths))


def device_name(device: str) -> str:
    if device != "cuda":
        return "cpu"
    import torch

    return torch.cuda.get_device_name()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    main()
