"""CUDA correctness and speed check, run on the lent GPU (see bench/RESULTS.md).

Builds a random-weight checkpoint with the real SmolLM2 shape (or loads a GGUF when given),
then compares mlxcel with transformers on CUDA in bfloat16 and runs the engine batched, with
the decode step as CUDA graphs and eagerly, beside transformers' eager `generate` at the same
batch sizes (tok/s with the 128-token prefill, and decode alone: first to last token);
`--qwen15` adds a random Qwen2.5-1.5B-shaped model at batch 1 (bytes of weights read per token
against the measured copy bandwidth):

    PYTHONPATH=src python3 bench/gpu_check.py [--gguf PATH] [--out DIR] [--qwen15]
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


QWEN15_SHAPE = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                    intermediate_size=8960, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                    rms_norm_eps=1e-6, tie_word_embeddings=True)


def random_checkpoint(folder: Path, shape: dict | None = None, family: str = "llama") -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config, cls = (Qwen2Config, Qwen2ForCausalLM) if family == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    model = cls(config(**(shape or SMOL_SHAPE)))
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


async def engine_runs(client, prompts: list[list[int]], n: int,  # noqa: ANN001
                      times: list[tuple[float, float]] | None = None) -> list[list[int]]:
    """Greedy tokens of each prompt; `times` gets each request's (first token, last token) clock."""
    from mlxcel.types import Request, SamplingParams

    async def one(i: int, p: list[int]) -> list[int]:
        toks: list[int] = []
        first = 0.0
        async for ev in client.generate(Request(f"g{i}-{time.monotonic_ns()}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))):
            if ev.token_ids and not toks:
                first = time.perf_counter()
            toks.extend(ev.token_ids)
        if times is not None:
            times.append((first, time.perf_counter()))
        return toks
    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def engine_speeds(loaded, mode: str, widths: tuple[int, ...], gen: int = 128) -> dict:  # noqa: ANN001
    """Aggregate decode tok/s of the engine at each width, with the decode step in `mode`."""
    from mlxcel.config import EngineConfig
    from mlxcel.engine.client import EngineClient
    from mlxcel.engine.loop import EngineCore, ModelShape

    config = EngineConfig(max_num_seqs=max(widths), ctx_size=max(widths) * 1024, max_num_batched_tokens=2048,
                          decode_step=mode)
    core = EngineCore(loaded.model, ModelShape.of(loaded.model.args), config, eos_token_ids=frozenset(),
                      device="cuda", dtype=torch.bfloat16)
    started = time.perf_counter()
    core.warm_decode_step()
    out: dict = {"warm_s": round(time.perf_counter() - started, 1)}
    core.start()
    client = EngineClient(core)
    g = torch.Generator().manual_seed(2)
    for width in widths:
        batch = [torch.randint(100, 40000, (128,), generator=g).tolist() for _ in range(width)]
        asyncio.run(engine_runs(client, batch, 8))
        start = time.perf_counter()
        times: list[tuple[float, float]] = []
        outs = asyncio.run(engine_runs(client, batch, gen, times))
        out[f"tok_s_batch_{width}"] = round(sum(map(len, outs)) / (time.perf_counter() - start), 1)
        # decode alone: tokens after each first one, from the first first token to the last token
        decode_s = max(end for _, end in times) - min(first for first, _ in times)
        out[f"decode_tok_s_batch_{width}"] = round(sum(len(o) - 1 for o in outs) / decode_s, 1)
    out["client"] = client
    return out


def hf_generate_speed(ref, width: int, gen: int = 128) -> float:  # noqa: ANN001
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(100, 40000, (width, 128), generator=g).cuda()
    with torch.inference_mode():
        ref.generate(ids[:, :16], max_new_tokens=4, min_new_tokens=4, do_sample=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        ref.generate(ids, max_new_tokens=gen, min_new_tokens=gen, do_sample=False)
        torch.cuda.synchronize()
    return round(width * gen / (time.perf_counter() - start), 1)


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * 20 * x.numel() / (time.perf_counter() - start)  # bytes read + written per second


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--out", type=Path, default=Path("/tmp"))
    parser.add_argument("--qwen15", action="store_true", help="also a random Qwen2.5-1.5B shape at batch 1")
    args = parser.parse_args()
    from mlxcel.layers.quant import fuse_projections
    from mlxcel.loading import load_model

    path = args.gguf or random_checkpoint(Path("/tmp/smol-random"))
    report: dict = {"checkpoint": str(path), "device": torch.cuda.get_device_name()}
    loaded = load_model(path, device="cuda", dtype=torch.bfloat16)
    fuse_projections(loaded.model)  # as serving.served_model does on CUDA
    ref = hf_model(path, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (5, 17, 64, 200, 731)]
    report["logits_bf16"] = compare_logits(loaded.model, ref, prompts)
    widths = (1, 8, 64)
    graphs = engine_speeds(loaded, "cuda-graph", widths)
    client = graphs.pop("client")
    alone = [asyncio.run(engine_runs(client, [p], 32))[0] for p in prompts]
    batched = asyncio.run(engine_runs(client, prompts, 32))
    client.core.stop()
    report["cuda_graph"] = graphs
    report["greedy_32_alone_vs_batched_equal"] = [a == b for a, b in zip(alone, batched)]
    eager = engine_speeds(loaded, "eager", widths)
    eager_client = eager.pop("client")
    eager_alone = [asyncio.run(engine_runs(eager_client, [p], 32))[0] for p in prompts]
    eager_client.core.stop()
    report["eager"] = eager
    report["greedy_32_graph_vs_eager_equal"] = [a == b for a, b in zip(alone, eager_alone)]
    report["transformers_generate"] = {f"tok_s_batch_{w}": hf_generate_speed(ref, w) for w in widths}
    del loaded, ref
    if args.qwen15:
        report["qwen15_bf16"] = qwen15_speed()
    text = json.dumps(report, indent=1)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(text)


def qwen15_speed() -> dict:
    from mlxcel.layers.quant import fuse_projections
    from mlxcel.loading import load_model

    path = random_checkpoint(Path("/tmp/qwen15-random"), QWEN15_SHAPE, family="qwen2")
    loaded = load_model(path, device="cuda", dtype=torch.bfloat16)
    fuse_projections(loaded.model)  # as serving.served_model does on CUDA
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    out = engine_speeds(loaded, "cuda-graph", (1,), gen=256)
    out.pop("client").core.stop()
    bandwidth = copy_bandwidth()
    ceiling = bandwidth / weight_bytes
    out.update(weight_gb=round(weight_bytes / 1e9, 2), copy_bandwidth_tb_s=round(bandwidth / 1e12, 2),
               ceiling_tok_s=round(ceiling, 1),
               percent_of_ceiling=round(100 * out["decode_tok_s_batch_1"] / ceiling, 1))
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    main()
