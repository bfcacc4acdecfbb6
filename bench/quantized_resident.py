"""Issue 42: memory of a quantized checkpoint as the CPU server keeps it, against its weight files.

Writes a random qwen3 checkpoint of a moderate shape, or takes a GGUF, then, in a fresh process, loads it the
way the server does (mapped, each linear packed from its stored codes by the CPU decode rewrite, the rest read)
and reports, against the resident weight bytes (`layers.quant.resident_bytes`) and the weight files' bytes:
- the anonymous and the file-backed resident memory (/proc/self/status RssAnon, RssFile) grown over the load,
  at its peak (sampled every 5 ms) and once loaded (steady, after `loading.release_load_memory`);
- the load's seconds.
The KV cache is not part of this (the engine allocates it apart, `--ctx-size` x the model's KV bytes a token).

    python bench/quantized_resident.py --format mlx        # mlx-lm's converter over a random transformers qwen3
    python bench/quantized_resident.py --format mlx-codes --hidden 2048 --layers 16   # random codes, MLX layout
    python bench/quantized_resident.py --format gptq --hidden 2048 --layers 16        # random codes, GPTQ layout
    python bench/quantized_resident.py --gguf PATH.gguf
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MEASURE = r"""
import json, sys, threading, time
import torch
from pathlib import Path
from mlxcel.layers.quant import quantize, resident_bytes
from mlxcel.loading import load_model
from mlxcel.loading.lazy import materialize_all

def status() -> dict:
    with open("/proc/self/status") as lines:
        fields = dict(line.split(":", 1) for line in lines)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "RssAnon", "RssFile")}

peak = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0}
done = threading.Event()
def sample() -> None:
    while not done.wait(0.005):
        for key, value in status().items():
            peak[key] = max(peak[key], value)

from mlxcel.layers import paged_attention
paged_attention.available()  # the CPU kernels' library, loaded (and built once) before the measure
load_model(Path(sys.argv[1]), lazy=True)  # the modules a load imports (the server has them before it loads)
import ctypes, gc
gc.collect(); ctypes.CDLL("libc.so.6").malloc_trim(0)
before = status()
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
started = time.monotonic()
loaded = load_model(Path(sys.argv[1]), lazy=True)
summary = quantize(loaded.model)
materialize_all(loaded.model)
if sys.argv[2] == "release":
    from mlxcel.loading import release_load_memory
    release_load_memory(loaded.model)
seconds = time.monotonic() - started
done.set(); sampler.join()
after = status()
grown = lambda values: {key: values[key] - before[key] for key in ("RssAnon", "RssFile", "VmRSS")}
print(json.dumps({"resident_bytes": resident_bytes(loaded.model), "steady": grown(after), "peak": grown(peak),
                  "load_s": round(seconds, 2), "summary": str(summary)}))
"""


def _qwen3_config(args: argparse.Namespace) -> dict:
    return dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                num_key_value_heads=max(1, args.hidden // 256), head_dim=64, tie_word_embeddings=True)


def write_mlx_converted(args: argparse.Namespace, tmp: Path) -> Path:
    """A random transformers qwen3 converted by mlx-lm's own converter."""
    import torch
    from mlx_lm import convert
    from transformers import AutoConfig, AutoModelForCausalLM

    hf, out = tmp / "hf", tmp / "mlx"
    config = AutoConfig.for_model("qwen3", **_qwen3_config(args))
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(hf)
    convert(str(hf), str(out), quantize=True, q_bits=args.bits, q_group_size=args.group)
    return out


def _linear_shapes(args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """Every linear of the qwen3 shape: name -> (out, in); the tied table as `model.embed_tokens`."""
    c = _qwen3_config(args)
    h, i, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * 64
    shapes = {"model.embed_tokens": (c["vocab_size"], h)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {p + "self_attn.q_proj": (h, h), p + "self_attn.k_proj": (kv, h), p + "self_attn.v_proj": (kv, h),
                   p + "self_attn.o_proj": (h, h), p + "mlp.gate_proj": (i, h), p + "mlp.up_proj": (i, h),
                   p + "mlp.down_proj": (h, i)}
    return shapes


def _float_tensors(args: argparse.Namespace) -> dict:
    import torch

    c, out = _qwen3_config(args), {}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out |= {p + "input_layernorm.weight": torch.ones(args.hidden, dtype=torch.bfloat16),
                p + "post_attention_layernorm.weight": torch.ones(args.hidden, dtype=torch.bfloat16),
                p + "self_attn.q_norm.weight": torch.ones(64, dtype=torch.bfloat16),
                p + "self_attn.k_norm.weight": torch.ones(64, dtype=torch.bfloat16)}
    return out | {"model.norm.weight": torch.ones(args.hidden, dtype=torch.bfloat16)}


def write_codes(args: argparse.Namespace, tmp: Path, layout: str) -> Path:
    """Random codes and scales in MLX's or AutoGPTQ's layout (speed and memory do not depend on the values),
    in shards of about 1 GB as the tools write them."""
    import torch
    from safetensors.torch import save_file

    out = tmp / layout
    out.mkdir()
    words = lambda rows, cols: torch.randint(-2**31, 2**31 - 1, (rows, cols), dtype=torch.int32)  # noqa: E731
    half = lambda rows, cols: (torch.rand(rows, cols) * 0.01).half()  # noqa: E731
    shard, shards, size = _float_tensors(args), [], 0
    for name, (n, k) in _linear_shapes(args).items():
        if layout == "mlx":
            tensors = {"weight": words(n, k * args.bits // 32), "scales": half(n, k // args.group),
                       "biases": half(n, k // args.group)}
        else:  # AutoGPTQ: qweight [K * b / 32, N], qzeros [G, N * b / 32], scales [G, N], g_idx [K]
            tensors = {"qweight": words(k * args.bits // 32, n), "qzeros": words(k // args.group, n * args.bits // 32),
                       "scales": half(k // args.group, n), "g_idx": (torch.arange(k) // args.group).to(torch.int32)}
            if name == "model.embed_tokens":  # GPTQ keeps the table float; the head is then the same table
                tensors = {"weight": (torch.randn(n, k) * 0.02).to(torch.bfloat16)}
        shard |= {f"{name}.{part}": t for part, t in tensors.items()}
        size += sum(t.nbytes for t in tensors.values())
        if size > 1 << 30:
            shards.append(shard)
            shard, size = {}, 0
    for index, tensors in enumerate([*shards, shard]):
        save_file(tensors, str(out / f"model-{index:05d}.safetensors"), metadata={"format": "pt"})
    quant = ({"quantization": {"bits": args.bits, "group_size": args.group}} if layout == "mlx" else
             {"quantization_config": {"quant_method": "gptq", "bits": args.bits, "group_size": args.group,
                                      "desc_act": False, "sym": True}})
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **_qwen3_config(args),
              "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
              **quant}
    (out / "config.json").write_text(json.dumps(config))
    return out


def measure(path: Path, release: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, str(path), "release" if release else "keep"],
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--format", choices=("mlx", "mlx-codes", "gptq"), default="mlx")
    parser.add_argument("--gguf", type=Path, help="measure this GGUF instead of writing a folder")
    parser.add_argument("--folder", type=Path, help="measure this quantized folder instead of writing one")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--no-release", action="store_true", help="skip release_load_memory (the before figures)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        if args.gguf is not None:
            path, file_bytes = args.gguf, args.gguf.stat().st_size
        else:
            path = args.folder or (write_mlx_converted(args, Path(tmp)) if args.format == "mlx" else
                                   write_codes(args, Path(tmp), "mlx" if args.format == "mlx-codes" else "gptq"))
            file_bytes = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        result = measure(path, release=not args.no_release)
    result["file_bytes"] = file_bytes
    resident = result["resident_bytes"]
    result["ratios_to_resident"] = {f"{when}_{key}": round(result[when][key] / resident, 3)
                                    for when in ("peak", "steady") for key in ("RssAnon", "RssFile", "VmRSS")}
    result["resident_over_file"] = round(resident / file_bytes, 3)
    settings = {k: str(v or "") if k in ("gguf", "folder") else v for k, v in vars(args).items()}
    print(json.dumps({**settings, **result}, indent=1))


if __name__ == "__main__":
    main()
