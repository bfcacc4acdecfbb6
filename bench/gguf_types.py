"""Issue 42: GGUFs in the K-quant, I-quant and MXFP4 types, made by llama.cpp's own `llama-quantize` from a
source GGUF, checked against the `gguf` package and (optionally) decoded with `mlxcel generate`.

Outside CI (it needs llama.cpp built: `cmake --build /tmp/llama-server/build --target llama-quantize`).
For each type it writes <out>/<stem>.<TYPE>.gguf (kept: a second run reuses it), then
  - lists the tensor types llama-quantize chose (it falls back where a row is not whole superblocks),
  - checks, on the smallest tensor of every type, that the codes and scales the loader keeps (`int8_levels`,
    `int4_levels`) give the package's dequantized values bit for bit,
  - with --generate N, runs `mlxcel generate` (greedy, N tokens) and reports its decode tokens/s and the
    weights line of the startup log (bits a weight, MiB resident).

    python bench/gguf_types.py --source ~/.cache/mlxcel/models/qwen2.5-coder-1.5b-instruct-0.2.0/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf \
        --types Q4_K_M,IQ4_XS --generate 64

Requantizing an already quantized source (`--allow-requantize`) loses quality; speed and memory do not
depend on it.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

QUANTIZE = Path("/tmp/llama-server/build/bin/llama-quantize")
DEFAULT_TYPES = "Q4_K_M,Q5_K_M,Q3_K_M,Q2_K,IQ4_XS,IQ4_NL,IQ3_S,MXFP4_MOE"


def quantize(source: Path, target: Path, type_name: str, threads: int) -> float:
    """llama-quantize `source` to `type_name` at `target` (niced: the machine is shared); seconds taken."""
    if target.exists():
        return 0.0
    started = time.monotonic()
    done = subprocess.run(["nice", "-n", "19", str(QUANTIZE), "--allow-requantize", str(source), str(target), type_name,
                           str(threads)], capture_output=True, text=True)
    if done.returncode != 0:
        target.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize {type_name}: {done.stderr.strip().splitlines()[-1:]}")
    return time.monotonic() - started


def check_types(path: Path) -> dict[str, int]:
    """Tensor counts by type; asserts the kept codes equal the package's dequantized values on one tensor of each."""
    from mlxcel.loading.gguf import GGUFFile

    file = GGUFFile(path)
    counts: dict[str, int] = {}
    smallest: dict[str, str] = {}
    for tensor in file.tensors.values():
        counts[tensor.type_name] = counts.get(tensor.type_name, 0) + 1
        if len(tensor.shape) == 2 and (tensor.type_name not in smallest
                                       or tensor.raw.size < file.tensors[smallest[tensor.type_name]].raw.size):
            smallest[tensor.type_name] = tensor.name
    for name in smallest.values():
        want = file.dequantize(name)
        stored = file.int8_levels(name)
        if stored is not None:
            codes, scale, low, _ = stored
            got = codes.reshape(len(codes), scale.shape[1], -1) * scale[..., None]
            got = got if low is None else got + low[..., None]
        elif (levels := file.int4_levels(name)) is not None:
            q, step, low4, _ = levels
            got = low4[..., None] + q.reshape(len(q), step.shape[1], -1) * step[..., None]
        else:
            continue  # float tensors: kept as they are
        assert np.array_equal(got.reshape(want.shape), want), f"{path.name}: {name} ({file.tensors[name].type_name})"
    return counts


def generate(path: Path, num_tokens: int, threads: int) -> tuple[str, str]:
    """`mlxcel generate` greedy: its decode speed line and the startup log's weights line."""
    done = subprocess.run([sys.executable, "-m", "mlxcel.cli", "generate", "-m", str(path), "-p",
                           "Write a Python function that reverses a linked list.", "-n", str(num_tokens), "--temp", "0",
                           "-c", "1024", "-t", str(threads), "-v"], capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        return f"failed: {done.stderr.strip().splitlines()[-1:]}", ""
    speed = re.search(r"generation: .*", done.stderr)
    weights = re.search(r"weights: (GGUF.*)", done.stderr)
    return (speed.group(0) if speed else "?"), (weights.group(1) if weights else "?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="a GGUF to requantize")
    parser.add_argument("--types", default=DEFAULT_TYPES, help=f"llama-quantize types (default {DEFAULT_TYPES})")
    parser.add_argument("--out", type=Path, default=Path("/tmp/mlxcel-gguf-types"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--generate", type=int, default=0, help="decode this many tokens with mlxcel generate")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.source.name.removesuffix(".gguf")
    for type_name in args.types.split(","):
        target = args.out / f"{stem}.{type_name}.gguf"
        try:
            seconds = quantize(args.source, target, type_name, args.threads)
        except RuntimeError as exc:
            print(f"{type_name}: {exc}")
            continue
        counts = check_types(target)
        line = f"{type_name}: {target.stat().st_size / 2**20:.1f} MiB (quantized in {seconds:.0f} s); tensors {counts}; codes == gguf: ok"
        if args.generate:
            speed, weights = generate(target, args.generate, args.threads)
            line += f"\n    {speed}\n    weights: {weights}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
