"""Issue 42: memory of an MLX 4-bit folder as the CPU server keeps it, against the folder's file size.

Writes a random qwen3 of a moderate shape (transformers), converts it with mlx-lm's own converter (4-bit,
groups of 64 by default), then, in a fresh process, loads it the way the server does (mapped, each linear
packed from its stored codes by the CPU decode rewrite) and reports the weights' resident bytes
(`layers.quant.resident_bytes`), the process's RSS growth over the load (after glibc's malloc_trim returns
the freed temporaries; the mapped files' pages read count in it), and the weight files' bytes. The KV
cache is not part of this (the engine allocates it apart, `--ctx-size` x the model's KV bytes a token).

    python bench/quantized_resident.py [--hidden 1024 --layers 8 --vocab 32768 --group 64 --bits 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MEASURE = r"""
import json, resource, sys, torch
from pathlib import Path
from mlxcel.layers.quant import quantize, resident_bytes
from mlxcel.loading import load_model
from mlxcel.loading.lazy import materialize_all

def rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))

import ctypes
from mlxcel.layers import paged_attention
paged_attention.available()  # the CPU kernels' library, loaded (and built once) before the measure
folder = Path(sys.argv[1])
before = rss()
loaded = load_model(folder, lazy=True)
summary = quantize(loaded.model)
materialize_all(loaded.model)
grown = rss()
ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed temporaries glibc still holds
after = rss()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"resident_bytes": resident_bytes(loaded.model), "rss_growth": after - before,
                  "rss_growth_before_trim": grown - before,
                  "peak_rss_growth": peak - before, "summary": str(summary)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--bits", type=int, default=4)
    args = parser.parse_args()
    import torch
    from mlx_lm import convert
    from transformers import AutoConfig, AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        hf, mlx = Path(tmp) / "hf", Path(tmp) / "mlx"
        config = AutoConfig.for_model("qwen3", vocab_size=args.vocab, hidden_size=args.hidden,
                                      intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
                                      num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256),
                                      head_dim=64, tie_word_embeddings=True)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(hf)
        convert(str(hf), str(mlx), quantize=True, q_bits=args.bits, q_group_size=args.group)
        file_bytes = sum(p.stat().st_size for p in mlx.glob("*.safetensors"))
        out = subprocess.run([sys.executable, "-c", MEASURE, str(mlx)], capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
    result["file_bytes"] = file_bytes
    result["resident_over_file"] = round(result["resident_bytes"] / file_bytes, 3)
    result["rss_growth_over_file"] = round(result["rss_growth"] / file_bytes, 3)
    print(json.dumps({**vars(args), **result}, indent=1))


if __name__ == "__main__":
    main()
