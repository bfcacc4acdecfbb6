"""The sampler's cost inside a decode step, on the lent GPU (issue 25; see bench/RESULTS.md):

    PYTHONPATH=src python3 bench/sampler_step.py [--compare OLD_SAMPLER.py] [--out DIR]

A step here is what the engine does per decode step: a forward is launched (stood in for by a
matmul chain of about `--forward-ms` on the GPU, so nothing but the sampler's own launches and
waits differs), then the batch is sampled and its tokens read. Reported per batch width, vocab
and request shape: ms per step, and the sampler's cost over a greedy step's. Logits are drawn
peaked like a trained model's (a few tokens hold most of the mass) or flat like random weights'
(top_p 0.95 keeps most of the vocabulary: every row spills past the candidates).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

MODES = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.8, "top_p": 0.95},
    "temp1": {"temperature": 1.0},
    "top_k40": {"temperature": 0.8, "top_k": 40, "top_p": 0.95},
    "ignore_eos": {"temperature": 0.8, "top_p": 0.95, "ignore_eos": True},
    "logprobs": {"temperature": 0.0, "logprobs": 1},
    "seeded": {"temperature": 0.8, "top_p": 0.95, "seed": 5},
}


def load_sampler(path: Path | None):  # noqa: ANN201
    if path is None:
        from mlxcel.engine import sampler
        return sampler
    spec = importlib.util.spec_from_file_location("sampler_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def logits_for(width: int, vocab: int, peaked: bool, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(width)
    x = torch.randn(width, vocab, generator=g)
    if peaked:  # a trained model's spread: a few dozen likely tokens over a long tail
        x = x * 2.0
        x[:, :64] += torch.linspace(16, 6, 64)
    return x.to(device, torch.bfloat16)


def step_ms(sampler, logits: torch.Tensor, fields: dict, forward, steps: int) -> float:  # noqa: ANN001
    from mlxcel.types import SamplingParams

    params = SamplingParams(**fields)
    rows = [sampler.SamplingRow(params, list(range(64)), 3, frozenset({2}), sampler.make_generator(params.seed))
            for _ in range(logits.shape[0])]
    for _ in range(3):
        forward()
        sampler.sample(logits, rows)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        forward()
        sampler.sample(logits, rows)
    return (time.perf_counter() - start) / steps * 1000


def fake_forward(ms: float):  # noqa: ANN201
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    for _ in range(5):  # the library's first calls set up
        torch.mm(a, a, out=out)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        torch.mm(a, a, out=out)
    torch.cuda.synchronize()
    n = max(1, round(ms / ((time.perf_counter() - start) / 50 * 1000)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            torch.mm(a, a, out=out)
    return graph.replay


def profile(sampler, case: str, forward, vocab: int) -> None:  # noqa: ANN001
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    mode, width = case.split("@")
    logits = logits_for(int(width), vocab, True, "cuda")
    step_ms(sampler, logits, MODES[mode], forward, 5)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step_ms(sampler, logits, MODES[mode], forward, 20)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", type=Path, help="another sampler.py to time beside the current one")
    parser.add_argument("--widths", default="1,16,64,256")
    parser.add_argument("--vocabs", default="49152,151936")
    parser.add_argument("--forward-ms", type=float, default=1.5)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--profile", help="MODE@WIDTH: print torch.profiler's table of that case instead")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    args = parser.parse_args()
    forward = fake_forward(args.forward_ms)
    samplers = {"current": load_sampler(None)}
    if args.compare:
        samplers["compared"] = load_sampler(args.compare)
    if args.profile:
        profile(samplers["current"], args.profile, forward, int(args.vocabs.split(",")[0]))
        return
    report: dict = {"device": torch.cuda.get_device_name(), "forward_ms": args.forward_ms}
    for vocab in [int(v) for v in args.vocabs.split(",")]:
        for peaked in (True, False):
            for width in [int(w) for w in args.widths.split(",")]:
                logits = logits_for(width, vocab, peaked, "cuda")
                for name, sampler in samplers.items():
                    figures = {mode: round(step_ms(sampler, logits, fields, forward, args.steps), 3)
                               for mode, fields in MODES.items()}
                    key = f"{name} vocab={vocab} {'peaked' if peaked else 'flat'} width={width}"
                    report[key] = figures
                    print(key, json.dumps(figures), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sampler_step.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    main()
