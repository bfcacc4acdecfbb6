"""Precision beside speed (issue 27): mlxcel's quantized CPU path and llama.cpp's on the same GGUF, text and
F32 reference, one table: perplexity, KL divergence and same top token against the F32 logits, decode tok/s.

The reference is llama.cpp's own: `llama-quantize --allow-requantize MODEL F32` (the stored weights
dequantized, nothing else changed), then `llama-perplexity -m F32 --kl-divergence-base BASE -f TEXT -c N`.
Both tools then read that base: `llama-perplexity --kl-divergence` on the quantized GGUF, and
`mlxcel perplexity --kl-divergence` (the server's engine path) once per --paths entry. Decode tok/s is
bench/run.py's single-stream figure (128-token prompt) through each server, measured in the same run.

    .venv/bin/python bench/quality.py --text TEXT                         # the embedded SmolLM2 Q4_1
    .venv/bin/python bench/quality.py --model qwen.gguf --text TEXT --chunks 6
    .venv/bin/python bench/quality.py --text TEXT --paths "default=;kv f16=-ctk f16 -ctv f16" --no-decode

The F32 GGUF and the base are cached in --work (4x the quantized file's size on disk for the F32 copy).
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import (LLAMA_SERVER, ROOT, GREEDY, llama_server_cmd, mlxcel_cmd, model_path, free_port,  # noqa: E402
                 run_server_peer)

from mlxcel.loading.gguf import GGUFFile  # noqa: E402
from mlxcel.text.tokenizer import Tokenizer  # noqa: E402

FIGURES = {"ppl": r"Mean PPL\(Q\)\s*:\s*([\d.]+)", "kld": r"Mean\s+KLD:\s*([-\d.]+)",
           "same_top": r"Same top p:\s*([\d.]+)"}


@dataclass
class Row:
    model: str
    path: str
    ppl: float | None = None
    kld: float | None = None
    same_top: float | None = None
    decode_tps: float | None = None


def parse(output: str) -> dict[str, float | None]:
    found = {key: re.search(pattern, output) for key, pattern in FIGURES.items()}
    return {key: float(m.group(1)) if m else None for key, m in found.items()}


def run_logged(cmd: list[str], log: Path) -> str:
    """Runs `cmd` (stderr to `log`), returns its stdout; a failure names the log."""
    print("$ " + shlex.join(cmd), file=sys.stderr, flush=True)
    with log.open("w") as err:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed (exit {done.returncode}); see {log}")
    return done.stdout


def base_file(bin_dir: Path, model: Path, text: Path, args: argparse.Namespace) -> Path:
    """llama.cpp's F32 logits of `model`'s weights dequantized (cached in --work)."""
    work = args.work / model.stem
    work.mkdir(parents=True, exist_ok=True)
    f32, base = work / "f32.gguf", work / f"base-c{args.ctx}-n{args.chunks}-{text.stem}.kld"
    if not f32.exists():
        run_logged([str(bin_dir / "llama-quantize"), "--allow-requantize", str(model), str(f32), "F32"],
                   work / "quantize.log")
    if not base.exists():
        run_logged([str(bin_dir / "llama-perplexity"), "-m", str(f32), "-f", str(text), "-c", str(args.ctx),
                    "--chunks", str(args.chunks), "-t", str(args.threads), "--kl-divergence-base", str(base)],
                   work / "base.log")
    return base


def llama_row(bin_dir: Path, model: Path, base: Path, args: argparse.Namespace) -> Row:
    out = run_logged([str(bin_dir / "llama-perplexity"), "-m", str(model), "-t", str(args.threads),
                      "--kl-divergence-base", str(base), "--kl-divergence"], args.work / model.stem / "llama.log")
    return Row(model.name, "llama.cpp", **parse(out))


def mlxcel_row(model: Path, base: Path, name: str, flags: list[str], args: argparse.Namespace) -> Row:
    out = run_logged([sys.executable, "-m", "mlxcel.cli", "perplexity", "-m", str(model), "-t", str(args.threads),
                      "--kl-divergence-base", str(base), "--kl-divergence", *flags],
                     args.work / model.stem / f"mlxcel-{re.sub(r'[^a-z0-9]+', '-', name.lower())}.log")
    return Row(model.name, f"mlxcel {name}".strip(), **parse(out))


def decode_tps(cmd: list[str] | None, port: int, model: Path) -> float | None:
    if cmd is None:
        return None
    tokenizer = Tokenizer.from_gguf(GGUFFile(model).metadata)
    return run_server_peer("quality", cmd, port, tokenizer, {"ignore_eos": True, **GREEDY}, True, True).decode_tps


def table(rows: list[Row]) -> str:
    def cell(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    lines = ["| model | path | PPL | KLD (mean) | same top % | decode tok/s |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r.model} | {r.path} | {cell(r.ppl, '.4f')} | {cell(r.kld, '.6f')} | {cell(r.same_top, '.3f')} | "
              f"{cell(r.decode_tps, '.1f')} |" for r in rows]
    return "\n".join(lines)


def paths(spec: str) -> list[tuple[str, list[str]]]:
    """"name=flags;name=flags" -> [(name, flags)]."""
    out = []
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        name, _, flags = entry.partition("=")
        out.append((name.strip(), shlex.split(flags)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or packaged name (default: the embedded SmolLM2)")
    parser.add_argument("--text", type=Path, required=True, help="English text, ~30 x 512 tokens (record which)")
    parser.add_argument("-c", "--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=-1, help="chunks scored (-1: all of the text)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--paths", default="default=", help='mlxcel runs, "name=flags;..." (default: the default path)')
    parser.add_argument("--llama-bin", type=Path, default=LLAMA_SERVER.parent,
                        help="folder with llama-perplexity, llama-quantize and llama-server")
    parser.add_argument("--work", type=Path, default=ROOT / "bench" / ".quality", help="F32 GGUFs, bases, logs")
    parser.add_argument("--no-decode", action="store_true", help="skip the decode tok/s column")
    args = parser.parse_args()
    model = model_path(args.model)
    base = base_file(args.llama_bin, model, args.text, args)
    rows = [llama_row(args.llama_bin, model, base, args)]
    print(table(rows).splitlines()[-1], file=sys.stderr, flush=True)
    if not args.no_decode:
        port = free_port()
        rows[0].decode_tps = decode_tps(llama_server_cmd(args.llama_bin / "llama-server", model, port, args.threads),
                                        port, model)
    for name, flags in paths(args.paths):
        row = mlxcel_row(model, base, name, flags, args)
        if not args.no_decode:
            port = free_port()
            row.decode_tps = decode_tps([*mlxcel_cmd(model, port, args.threads), *flags], port, model)
        rows.append(row)
        print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)  # each row as it lands
    print(table(rows))


if __name__ == "__main__":
    main()
