"""Issue 42's GPU figures: a quantized folder kept quantized on CUDA against the same weights in bfloat16.

    PYTHONPATH=src python3 bench/gpu_quantized.py [--out DIR] [--widths 1,64] [--gen 64] [--layers 24]

Writes two random folders of a Qwen3 shape (hidden 2048, 24 layers, 16 query / 8 KV heads of 128, MLP 6144,
vocabulary 151,936, untied head: about 1.7 B parameters): an MLX affine 4-bit one (groups of 64, every projection
and the head) and a compressed-tensors FP8 one (e4m3, a scale per output channel). Each is served three ways:
dequantized to bfloat16 (today's CUDA path, `--quantize off`), and kept as stored (layers/quant_cuda.py: the 4-bit
levels in torch's int4 GEMM, FP8 through `torch._scaled_mm`). Reported: logits of the kept model against the
bfloat16-dequantized one (relative error, top-1 agreement), the weights' resident bytes and the GPU memory
allocated, and the engine's aggregate decode tok/s with the decode step as CUDA graphs at each width.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import engine_speeds  # noqa: E402

SHAPE = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=32768,
             tie_word_embeddings=False, rms_norm_eps=1e-6)
GROUP = 64


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0..15) -> int32 words [N, K / 8], the first code in the lowest bits (MLX's layout)."""
    fields = q.to(torch.int64).view(q.shape[0], -1, 8) << (torch.arange(8, device=q.device) * 4)
    words = fields.sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def write_folder(folder: Path, kind: str, shape: dict) -> Path:
    """A random checkpoint of `shape` with every projection (and the head) stored as `kind` (mlx4 | fp8)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3", **shape)
    with torch.device("meta"):
        names = {n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_config(config).named_parameters()}
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for name, size in names.items():
        stem = name.removesuffix(".weight")
        if name.endswith("proj.weight") or name == "lm_head.weight":
            n, k = size
            if kind == "mlx4":
                q = torch.randint(0, 16, (n, k), generator=g, device="cuda", dtype=torch.uint8)
                scales = (0.002 + 0.002 * torch.rand(n, k // GROUP, generator=g, device="cuda")).half()
                tensors[name] = _pack4(q).cpu()
                tensors[f"{stem}.scales"] = scales.cpu()
                tensors[f"{stem}.biases"] = (-8 * scales.float()).half().cpu()
            else:
                codes = (torch.randn(n, k, generator=g, device="cuda") * 64).clamp(-448, 448)
                tensors[name] = codes.to(torch.float8_e4m3fn).cpu()
                tensors[f"{stem}.weight_scale"] = torch.full((n, 1), 0.02 / 64, device="cuda").cpu()
        elif "norm" in name:
            tensors[name] = torch.ones(size, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(size, generator=g, device="cuda") * 0.02).to(torch.bfloat16).cpu()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    block = ({"quantization": {"group_size": GROUP, "bits": 4}} if kind == "mlx4" else {"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}}})
    (folder / "config.json").write_text(json.dumps({**config.to_dict(), **block}))
    return folder


def load(folder: Path, keep: bool):  # noqa: ANN201
    from mlxcel.layers.quant import fuse_projections
    from mlxcel.layers.quant_cuda import keep_quantized
    from mlxcel.loading import load_model
    from mlxcel.loading.lazy import materialize_all

    loaded = load_model(folder, device="cuda", dtype=torch.bfloat16, lazy=keep)
    summary = str(keep_quantized(loaded.model, "cuda")) if keep else "bfloat16 (dequantized at load)"
    materialize_all(loaded.model)
    fuse_projections(loaded.model)  # as serving.served_model does on CUDA
    return loaded, summary


@torch.inference_mode()
def logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:  # noqa: ANN001
    from mlxcel.layers.attention import AttentionContext, SequenceSlice

    out = []
    for ids in prompts:
        ctx = AttentionContext([SequenceSlice(0, len(ids), len(ids))], None, "cuda")
        hidden = model(torch.tensor(ids, device="cuda"), torch.arange(len(ids), device="cuda"), ctx)
        out.append(model.compute_logits(hidden).float())
    return out


def measure(folder: Path, keep: bool, widths: tuple[int, ...], gen: int, prompts: list[list[int]],
            reference: list[torch.Tensor] | None, speeds: bool = True) -> tuple[dict, list[torch.Tensor]]:
    from mlxcel.layers.quant import resident_bytes

    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    started = time.perf_counter()
    loaded, summary = load(folder, keep)
    report: dict = {"weights": summary, "load_s": round(time.perf_counter() - started, 1),
                    "resident_bytes": resident_bytes(loaded.model),
                    "cuda_allocated_bytes": torch.cuda.memory_allocated() - base}
    got = logits(loaded.model, prompts)
    if reference is not None:
        report["relative_logit_error"] = [round(float((a - b).norm() / b.norm()), 4) for a, b in zip(got, reference)]
        report["top1_agreement"] = round(float(torch.cat([(a.argmax(-1) == b.argmax(-1)).float()
                                                          for a, b in zip(got, reference)]).mean()), 4)
    print(json.dumps(report), flush=True)
    if speeds:
        result = engine_speeds(loaded, "cuda-graph", widths, gen=gen)
        result.pop("client").core.stop()
        report.update(result)
    del loaded
    print(json.dumps(report), flush=True)
    return report, got


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("/tmp"))
    parser.add_argument("--widths", default="1,64")
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--layers", type=int, default=24)
    args = parser.parse_args()
    widths = tuple(int(w) for w in args.widths.split(","))
    shape = dict(SHAPE, num_hidden_layers=args.layers)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (5, 64, 200)]
    report: dict = {"device": torch.cuda.get_device_name(), "shape": shape}
    for kind in ("mlx4", "fp8"):
        started = time.perf_counter()
        folder = write_folder(Path(f"/tmp/quantized-{kind}"), kind, shape)
        report[kind] = {"write_s": round(time.perf_counter() - started, 1),
                        "file_bytes": sum(p.stat().st_size for p in folder.glob("*.safetensors"))}
        # bfloat16 speeds once (the same shape either way); the FP8 folder's bf16 logits as its reference
        report[kind]["bf16"], reference = measure(folder, False, widths, args.gen, prompts, None,
                                                  speeds=kind == "mlx4")
        report[kind]["kept"], _ = measure(folder, True, widths, args.gen, prompts, reference)
        del reference
        print(json.dumps(report), flush=True)
    for kind in ("mlx4", "fp8"):
        report[kind]["decode_ratio_vs_bf16"] = {
            w: round(report[kind]["kept"][f"tok_s_batch_{w}"] / report["mlx4"]["bf16"][f"tok_s_batch_{w}"], 2)
            for w in widths}
    text = json.dumps(report, indent=1)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_quantized.json").write_text(text)


if __name__ == "__main__":
    main()
