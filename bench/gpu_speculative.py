"""Speculative decoding on the lent GPU (issue 12): prompt lookup vs plain decoding, CUDA graphs.

    PYTHONPATH=src python3 bench/gpu_speculative.py [--shape smol|qwen15] [--draft-max 8] [--gen 128]
    PYTHONPATH=src python3 bench/gpu_speculative.py --model T.gguf --draft-model D.gguf --prompts P.json

With `--model` and `--draft-model` (real checkpoints, e.g. the Qwen2.5-Coder 1.5B / 0.5B pair,
carried to the device in slices), full-model drafting vs plain decoding instead, bfloat16, batch 1,
on the prompts of P.json ({name: token ids}, rendered and tokenized on the CPU machine by
`bench/speculative.py --dump-prompts P.json`, so the device needs no chat template or tokenizer).

A random-weight checkpoint of the given shape (no real checkpoint fits the device's transfer
limit), bfloat16, batch 1, decode step as CUDA graphs; the prompt is a random 150-token span
written twice, so prompt lookup finds drafts. With random weights the acceptance says little
about real text: this checks the mechanics on CUDA (verify rows in captured graphs, identity of
the greedy streams) and the cost of a verify round. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def engine(loaded, speculative, draft=None, device: str = "cuda") -> object:  # noqa: ANN001
    from mlxcel.config import EngineConfig
    from mlxcel.engine.client import EngineClient
    from mlxcel.engine.loop import EngineCore, ModelShape
    from mlxcel.engine.spec import DraftPolicy
    from mlxcel.engine.spec.draft_model import ModelDrafter

    config = EngineConfig(max_num_seqs=2, ctx_size=2 * 1024, decode_step="auto", speculative=speculative)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    drafts = None
    if draft is not None:  # as serving.served_model._draft_policy builds it
        shape = ModelShape.of(draft.model.args)
        drafter = ModelDrafter(draft.model, shape, num_blocks=2 * 1024 // config.block_size + 8,
                               block_size=config.block_size, device=device, dtype=dtype,
                               mode=config.decode_step_mode(device),
                               max_rows=max(config.max_num_seqs, speculative.draft_max + 1))
        drafter.warm()
        drafts = DraftPolicy(speculative, drafter)
    core = EngineCore(loaded.model, ModelShape.of(loaded.model.args), config, eos_token_ids=frozenset(),
                      device=device, dtype=dtype, drafts=drafts)
    started = time.perf_counter()
    core.warm_decode_step()
    warm = time.perf_counter() - started
    core.start()
    return EngineClient(core), warm


def generate(client, prompt: list[int], n: int) -> tuple[list[int], float]:  # noqa: ANN001
    from mlxcel.types import Request, SamplingParams

    async def one() -> tuple[list[int], float]:
        tokens: list[int] = []
        first = last = 0.0
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        async for event in client.generate(Request(f"g{time.monotonic_ns()}", list(prompt), params, cache_prompt=False)):
            last = time.perf_counter()
            first = first or last
            tokens.extend(event.token_ids)
        return tokens, (len(tokens) - 1) / max(last - first, 1e-9)

    return asyncio.run(one())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="smol", choices=("smol", "qwen15"))
    parser.add_argument("--draft-max", type=int, default=8)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--model", type=Path, help="target checkpoint (full-model drafting with --draft-model)")
    parser.add_argument("--draft-model", type=Path)
    parser.add_argument("--prompts", type=Path, help="JSON {name: token ids} for --model")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to try this script out")
    args = parser.parse_args()
    if args.model is not None:
        full_model_drafting(args)
        return
    from gpu_check import QWEN15_SHAPE, SMOL_SHAPE, random_checkpoint

    from mlxcel.config import SpeculativeConfig
    from mlxcel.loading import load_model

    shape = SMOL_SHAPE if args.shape == "smol" else QWEN15_SHAPE
    family = "llama" if args.shape == "smol" else "qwen2"
    loaded = load_model(random_checkpoint(Path(f"/tmp/{args.shape}-random"), shape, family), device="cuda",
                        dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    span = torch.randint(100, 40000, (150,), generator=g).tolist()
    prompts = [span + span, torch.randint(100, 40000, (300,), generator=g).tolist()]
    report: dict = {"device": torch.cuda.get_device_name(), "shape": args.shape, "draft_max": args.draft_max}
    clients = {"plain": engine(loaded, SpeculativeConfig()),
               "lookup": engine(loaded, SpeculativeConfig(draft_kind="prompt-lookup", draft_max=args.draft_max))}
    for label, (client, warm) in clients.items():
        report[f"{label}_warm_s"] = round(warm, 1)
        generate(client, prompts[0], 8)  # first-call costs
    for i, prompt in enumerate(prompts):
        streams = {}
        for label, (client, _) in clients.items():
            before = client.core.stats().drafts
            streams[label], speed = generate(client, prompt, args.gen)
            after = client.core.stats().drafts
            report[f"prompt{i}_{label}_tok_s"] = round(speed, 1)
            if label == "lookup":
                drafted = after.num_drafted - before.num_drafted
                report[f"prompt{i}_acceptance"] = round((after.num_accepted - before.num_accepted) / max(drafted, 1), 3)
        report[f"prompt{i}_identical"] = streams["plain"] == streams["lookup"]
        if not report[f"prompt{i}_identical"]:
            report[f"prompt{i}_first_difference"] = next(
                j for j, (a, b) in enumerate(zip(streams["plain"], streams["lookup"])) if a != b)
    for client, _ in clients.values():
        client.core.stop()
    print(json.dumps(report, indent=1))


def full_model_drafting(args: argparse.Namespace) -> None:
    from mlxcel.config import SpeculativeConfig
    from mlxcel.loading import load_model

    started = time.perf_counter()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    target = load_model(args.model, device=args.device, dtype=dtype)
    draft = load_model(args.draft_model, device=args.device, dtype=dtype)
    report: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "model": args.model.name, "draft": args.draft_model.name,
                    "draft_max": args.draft_max, "load_s": round(time.perf_counter() - started, 1)}
    prompts = json.loads(args.prompts.read_text())
    spec = SpeculativeConfig(draft_kind="full-model", draft_model=str(args.draft_model), draft_max=args.draft_max)
    runs = {"plain": engine(target, SpeculativeConfig(), device=args.device),
            "drafted": engine(target, spec, draft, device=args.device)}
    for label, (client, warm) in runs.items():
        report[f"{label}_warm_s"] = round(warm, 1)
        generate(client, next(iter(prompts.values())), 8)  # first-call costs
    for name, prompt in prompts.items():
        streams = {}
        for label, (client, _) in runs.items():
            before = client.core.stats().drafts
            best = 0.0
            for _ in range(2):
                streams[label], speed = generate(client, prompt, args.gen)
                best = max(best, speed)
            after = client.core.stats().drafts
            report[f"{name}_{label}_tok_s"] = round(best, 1)
            if label == "drafted":
                drafted = after.num_drafted - before.num_drafted
                report[f"{name}_acceptance"] = round((after.num_accepted - before.num_accepted) / max(drafted, 1), 3)
        report[f"{name}_speedup"] = round(report[f"{name}_drafted_tok_s"] / report[f"{name}_plain_tok_s"], 2)
        report[f"{name}_identical"] = streams["plain"] == streams["drafted"]
    for client, _ in runs.values():
        client.core.stop()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
