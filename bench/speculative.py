"""Speculative decoding (issue 12): decode speed with and without drafts, and the acceptance rate.

    PYTHONPATH=src python3 bench/speculative.py [--kind prompt-lookup] [--draft-model PATH] [--model PATH]
        [--threads 2] [--device cpu|cuda] [--decode-step auto] [--draft-max 8] [--max-tokens 200] [--repeats 1] [--rounds 1]
        [--llama-server PATH]

In-process, one request at a time (batch 1), the model's chat template around input-grounded
tasks (rewrite or edit a given code or text passage, quote a document) for prompt lookup and
code-completion tasks for full-model drafting, temperature 0. Each task
runs on an engine without speculation and one with it; the streams must be identical (checked).
Decode tok/s = (generated tokens - 1) / (time of the last token - time of the first token), so the
prompt's prefill is left out. Prints a JSON line per task and a markdown table.

Where a llama-server binary is found (`--llama-server`, default the bench's build), the same
rendered prompts also run on llama-server without and with its own speculation: the same drafter
(`--spec-type draft-simple -md`) for full-model drafting, `--spec-type ngram-simple` for prompt lookup, `--spec-draft-n-max`
as `--draft-max`; one request at a time, temperature 0. Its figure is its own `predicted_per_second`
(decode after the first token) and its acceptance `draft_n_accepted / draft_n`.

`--device cuda` runs both engines on the GPU (bfloat16 weights, CUDA graphs) and skips llama-server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from run import free_port, model_path, wait_ready  # noqa: E402 - bench/run.py, beside this file

from mlxcel.config import DECODE_STEPS  # noqa: E402

CODE = '''import json


def load_users(path):
    with open(path) as handle:
        users = json.load(handle)
    result = []
    for user in users:
        if user.get("active"):
            result.append({"name": user["name"], "email": user["email"].lower()})
    return result


def main():
    users = load_users("users.json")
    for user in users:
        print(user["name"], user["email"])


if __name__ == "__main__":
    main()
'''
TEXT = ("The library opens at nine in the morning and closes at six in the evening. Visitors may borrow up "
        "to five books at a time for three weeks. Books can be renewed twice online or at the front desk. "
        "Late returns cost ten cents a day per book. The reading room on the second floor is quiet at all "
        "times, and group study rooms can be booked a week ahead.")
TASKS = {
    "rename-variable": f"Rewrite this Python code with the variable `users` renamed to `members`. Reply with the "
                       f"whole code only.\n\n```python\n{CODE}```",
    "add-docstrings": f"Add a one-line docstring to each function of this code and return the full code.\n\n"
                      f"```python\n{CODE}```",
    "edit-text": f"Rewrite this notice, changing every number written as a word into digits; keep everything "
                 f"else the same.\n\n{TEXT}",
    "quote-document": f"Document:\n{TEXT}\n\nQuote, word for word, the two sentences of the document about "
                      f"borrowing and renewing books.",
}
# Full-model drafting is measured on code completion (issue 12): nothing to copy from the prompt.
COMPLETION_TASKS = {
    "binary-search": "Write a Python function `binary_search(items, target)` that returns the index of target "
                     "in the sorted list items, or -1. Reply with the code only.",
    "lru-cache": "Write a Python class `LRUCache` with `get(key)` and `put(key, value)` methods and a fixed "
                 "capacity, using collections.OrderedDict. Reply with the code only.",
    "parse-csv": "Write a Python function that reads a CSV file of name,age rows and returns the average age, "
                 "skipping malformed rows. Reply with the code only.",
    "fizzbuzz-tests": "Write pytest tests for a function `fizzbuzz(n)` that returns 'Fizz', 'Buzz', 'FizzBuzz' "
                      "or the number as a string. Reply with the code only.",
}


def serve(model: str | None, decode_step: str, speculative: object, draft: str | None, device: str = "cpu") -> object:
    from mlxcel.config import EngineConfig
    from mlxcel.loading import resolve_model
    from mlxcel.serving.chat_model import start_served_model
    from mlxcel.serving.served_model import RuntimeOptions

    config = EngineConfig(max_num_seqs=2, ctx_size=2 * 4096, decode_step=decode_step, speculative=speculative,
                          compile_cache_dir="/tmp/mlxcel-bench-compile-cache")
    return start_served_model(resolve_model(model), RuntimeOptions(warmup=True, device=device), config,
                              draft=resolve_model(draft) if draft else None)


@dataclass
class EngineRun:
    prompts: dict[str, list[int]]
    tasks: dict[str, dict]  # name -> stream, best speed, drafted and accepted counts


def run_engine(args: argparse.Namespace, spec: object, draft: str | None, tasks: dict[str, str]) -> EngineRun:
    """Every task on one engine, started for it and closed after.

    NOTE: one engine at a time: a second engine idle in the same process cut the first one's
    decode from 78 to 31 tok/s here (2 cores), which would make both figures too low."""
    served = serve(args.model, args.decode_step, spec, draft, args.device)
    try:
        prompts = render_prompts(args.model, tasks)
        results: dict[str, dict] = {}
        for name, prompt in prompts.items():
            before = served.engine.core.stats().drafts
            best = 0.0
            for _ in range(args.repeats):
                stream, speed = run_task(served, prompt, args.max_tokens)
                best = max(best, speed)
            after = served.engine.core.stats().drafts
            results[name] = {"stream": stream, "speed": best, "drafted": after.num_drafted - before.num_drafted,
                             "accepted": after.num_accepted - before.num_accepted}
        return EngineRun(prompts, results)
    finally:
        served.close()


def render_prompts(model: str | None, tasks: dict[str, str]) -> dict[str, list[int]]:
    """Each task through the model's chat template and tokenizer, without loading its weights."""
    from mlxcel.loading import open_checkpoint, resolve_model
    from mlxcel.serving.served_model import load_tokenizer
    from mlxcel.text.chat_template import load_chat_template

    checkpoint = open_checkpoint(resolve_model(model).path)
    tokenizer = load_tokenizer(checkpoint)
    template = load_chat_template(gguf_metadata=checkpoint.gguf.metadata if checkpoint.gguf else None,
                                  model_dir=checkpoint.model_dir)
    return {name: tokenizer.encode(template.render([{"role": "user", "content": task}], add_generation_prompt=True),
                                   add_special_tokens=False) for name, task in tasks.items()}


def run_task(served: object, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    from mlxcel.types import Request, SamplingParams

    async def one() -> tuple[list[int], float]:
        tokens: list[int] = []
        first = last = 0.0
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        async for event in served.engine.generate(Request(f"b{time.monotonic_ns()}", list(prompt), params,
                                                          cache_prompt=False)):
            if event.token_ids:
                last = time.monotonic()
                first = first or last
                tokens.extend(event.token_ids)
        return tokens, (len(tokens) - 1) / max(last - first, 1e-9)

    return asyncio.run(one())


LLAMA_SERVER = Path(os.environ.get("MLXCEL_BENCH_LLAMA_SERVER", "/tmp/llama-server/build/bin/llama-server"))


class LlamaServer:
    """llama-server on a free loopback port with the target and `spec` (its speculation flags)."""

    def __init__(self, binary: Path, model: Path, spec: list[str], threads: int) -> None:
        self.port = free_port()
        cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
               "-tb", str(threads), "-c", "4096", "--parallel", "1", "-nr", *spec]
        self.log = open(f"/tmp/bench-llama-server-{self.port}.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"
        wait_ready(self.base, self.proc)

    def run(self, prompt: list[int], max_tokens: int) -> tuple[float, int, int]:
        """Decode tok/s, drafted and accepted tokens of one temperature-0 completion of `prompt`."""
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "cache_prompt": False}
        timings = httpx.post(f"{self.base}/completion", json=body, timeout=600).json()["timings"]
        return timings["predicted_per_second"], timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def llama_server_rows(binary: Path, args: argparse.Namespace, prompts: dict[str, list[int]]) -> list[dict]:
    """The tasks on llama-server without and with its speculation of the same kind."""
    from mlxcel.loading import resolve_model

    model = resolve_model(args.model).path
    spec = ["--spec-draft-n-max", str(args.draft_max)]
    if args.kind == "full-model":
        spec += ["--spec-type", "draft-simple", "-md", str(resolve_model(args.draft_model).path),
                 "-td", str(args.threads), "-tbd", str(args.threads)]
    else:
        spec += ["--spec-type", "ngram-simple"]
    speeds: dict[str, dict[str, float]] = {name: {} for name in prompts}
    counts: dict[str, list[int]] = {name: [0, 0] for name in prompts}
    for label, flags in (("plain", []), ("spec", spec)):
        server = LlamaServer(binary, model, flags, args.threads)
        try:
            for name, prompt in prompts.items():
                for _ in range(args.repeats):
                    speed, drafted, accepted = server.run(prompt, args.max_tokens)
                    speeds[name][label] = max(speeds[name].get(label, 0.0), speed)
                    if flags:
                        counts[name][0] += drafted
                        counts[name][1] += accepted
        finally:
            server.close()
    return [{"task": name, "llama_plain_tok_s": round(s["plain"], 1), "llama_spec_tok_s": round(s["spec"], 1),
             "llama_speedup": round(s["spec"] / s["plain"], 2),
             "llama_acceptance": round(counts[name][1] / counts[name][0], 3) if counts[name][0] else 0.0}
            for name, s in speeds.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--kind", default="prompt-lookup", choices=("prompt-lookup", "full-model"))
    parser.add_argument("--draft-model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (bfloat16 weights, CUDA graphs)")
    parser.add_argument("--decode-step", default="auto", choices=DECODE_STEPS)
    parser.add_argument("--draft-max", type=int, default=8)
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1,
                        help="start the plain and the speculating engine this many times, alternately, and keep "
                             "each task's best speed: this machine's speed drifts by tens of percent over minutes")
    parser.add_argument("--dump-prompts", type=Path, help="write the tasks' rendered prompts as JSON {name: token ids} "
                        "(for bench/gpu_speculative.py) and exit")
    parser.add_argument("--llama-server", type=Path, default=LLAMA_SERVER,
                        help="llama-server binary for the -md comparison (full-model drafting)")
    args = parser.parse_args()
    from mlxcel.config import SpeculativeConfig

    torch.set_num_threads(args.threads)
    # Packaged names resolve to files (the Qwen2.5-Coder pair is installed on first use).
    args.model = str(model_path(args.model)) if args.model else None
    args.draft_model = str(model_path(args.draft_model)) if args.draft_model else None
    spec = SpeculativeConfig(draft_kind=args.kind, draft_max=args.draft_max, ngram_size=args.ngram,
                             draft_model=args.draft_model)
    tasks = COMPLETION_TASKS if args.kind == "full-model" else TASKS
    if args.dump_prompts is not None:
        args.dump_prompts.write_text(json.dumps(render_prompts(args.model, tasks)))
        return
    runs: dict[str, EngineRun] = {}
    for _ in range(args.rounds):
        for label, config, draft in (("plain", SpeculativeConfig(), None), (args.kind, spec, args.draft_model)):
            run = run_engine(args, config, draft, tasks)
            if label in runs:  # keep the best speed (and the counts of the first round)
                for name, result in run.tasks.items():
                    kept = runs[label].tasks[name]
                    assert result["stream"] == kept["stream"], f"{label} {name}: another stream in another round"
                    kept["speed"] = max(kept["speed"], result["speed"])
            else:
                runs[label] = run
    prompts = runs["plain"].prompts
    rows = []
    for name in tasks:
        plain, fast = runs["plain"].tasks[name], runs[args.kind].tasks[name]
        drafted, accepted = fast["drafted"], fast["accepted"]
        row = {"task": name, "prompt_tokens": len(prompts[name]), "generated": len(plain["stream"]),
               "plain_tok_s": round(plain["speed"], 1), "spec_tok_s": round(fast["speed"], 1),
               "speedup": round(fast["speed"] / plain["speed"], 2),
               "acceptance": round(accepted / drafted, 3) if drafted else 0.0,
               "accepted_per_token": round(accepted / max(len(plain["stream"]) * args.repeats, 1), 3),
               "identical": plain["stream"] == fast["stream"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n| task | prompt | generated | plain tok/s | {args.kind} tok/s | speedup | acceptance | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['task']} | {r['prompt_tokens']} | {r['generated']} | {r['plain_tok_s']} | {r['spec_tok_s']} | "
              f"{r['speedup']}x | {r['acceptance']:.0%} | {r['identical']} |")
    if args.llama_server.exists() and args.device == "cpu":
        peer = llama_server_rows(args.llama_server, args, prompts)
        print("\n| task | mlxcel plain | mlxcel spec | speedup | llama-server plain | llama-server spec | speedup "
              "| llama-server acceptance | mlxcel / llama-server, spec |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r, p in zip(rows, peer):
            print(json.dumps(p), file=sys.stderr, flush=True)
            print(f"| {r['task']} | {r['plain_tok_s']} | {r['spec_tok_s']} | {r['speedup']}x | {p['llama_plain_tok_s']} "
                  f"| {p['llama_spec_tok_s']} | {p['llama_speedup']}x | {p['llama_acceptance']:.0%} "
                  f"| {r['spec_tok_s'] / p['llama_spec_tok_s']:.2f}x |")


if __name__ == "__main__":
    main()
