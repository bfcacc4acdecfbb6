"""CUDA correctness and speed check, run on the lent GPU (see bench/RESULTS.md).

Builds a random-weight checkpoint with the real SmolLM2 shape (or loads a GGUF when given),
then compares mlxcel with transformers on CUDA in bfloat16 and runs the engine batched:

    PYTHONPATH=src python3 bench/gpu_check.py [--gguf PATH] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch

SMOL_SHAPE = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                  intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                  rms_norm_eps=1e-5, tie_word_embeddings=True)


def random_checkpoint(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOL_SHAPE))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def hf_model(path: Path, dtype: torch.dtype):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).cuda().eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()


def compare_logits(ours, ref, prompts: list[list[int]]) -> dict:  # noqa: ANN001
    from mlxcel.layers.attention import AttentionContext, SequenceSlice

    worst, agree, total = 0.0, 0, 0
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor(p, device="cuda")
            h = ours(ids, torch.arange(len(p), device="cuda"), AttentionContext([SequenceSlice(0, len(p), len(p))], device="cuda"))
            a = ours.compute_logits(h).float()
            b = ref(ids[None]).logits[0].float()
            worst = max(worst, float((a - b).abs().max() / b.abs().max()))
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += len(p)
    return {"max_rel_logit_diff": worst, "top1_agreement": agree / total}


def greedy_ref(ref, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    with torch.inference_mode():
        out = ref.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


async def engine_runs(client, prompts: list[list[int]], n: int) -> list[list[int]]:  # noqa: ANN001
    from mlxcel.types import Request, SamplingParams

    async def one(i: int, p: list[int]) -> list[int]:
        toks: list[int] = []
        async for ev in client.generate(Request(f"g{i}-{time.monotonic_ns()}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))):
            toks.extend(ev.token_ids)
        return toks
    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--out", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    from mlxcel.config import EngineConfig
    from mlxcel.engine.client import EngineClient
    from mlxcel.engine.loop import EngineCore, ModelShape
    from mlxcel.loading import load_model

    path = args.gguf or random_checkpoint(Path("/tmp/smol-random"))
    report: dict = {"checkpoint": str(path), "device": torch.cuda.get_device_name()}
    loaded = load_model(path, device="cuda", dtype=torch.bfloat16)
    ref = hf_model(path, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (5, 17, 64, 200, 731)]
    report["logits_bf16"] = compare_logits(loaded.model, ref, prompts)
    core = EngineCore(loaded.model, ModelShape.of(loaded.model.args), EngineConfig(max_num_seqs=64, ctx_size=64 * 1024,
                      max_num_batched_tokens=2048), eos_token_ids=frozenset(), device="cuda", dtype=torch.bfloat16)
    core.start()
    client = EngineClient(core)
    alone = [asyncio.run(engine_runs(client, [p], 32))[0] for p in prompts]
    batched = asyncio.run(engine_runs(client, prompts, 32))
    refs = [greedy_ref(ref, p, 32) for p in prompts]
    report["greedy_32_engine_alone_vs_batched_equal"] = [a == b for a, b in zip(alone, batched)]
    report["greedy_32_engine_vs_transformers_prefix_agree"] = [
        next((i for i, (x, y) in enumerate(zip(a, r)) if x != y), len(a)) for a, r in zip(alone, refs)]
    for width in (1, 8, 64):
        batch = [torch.randint(100, 40000, (128,), generator=g).tolist() for _ in range(width)]
        asyncio.run(engine_runs(client, batch[:1], 4))
        start = time.perf_counter()
        outs = asyncio.run(engine_runs(client, batch, 128))
        report[f"engine_decode_tok_s_batch_{width}"] = sum(map(len, outs)) / (time.perf_counter() - start)
    core.stop()
    text = json.dumps(report, indent=1)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(text)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    main()
