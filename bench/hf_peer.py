"""transformers `generate` peer for bench/run.py; prints one JSON line of figures.

    python bench/hf_peer.py MODEL.gguf THREADS [--quick|--full]
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def timed_generate(model, inputs: dict, new_tokens: int) -> float:  # noqa: ANN001
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return time.perf_counter() - start


def main() -> None:
    path, threads, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    quick = mode == "--quick"
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16).eval()
    tok.pad_token = tok.pad_token or tok.eos_token
    tok.padding_side = "left"
    words = "river stone market lantern orbit velvet harbor signal copper meadow " * 300
    def ids(n: int, salt: int = 0) -> torch.Tensor:
        return tok(f"Story {salt}: " + words, return_tensors="pt").input_ids[:, :n]
    gen = 64 if quick else 256
    single = {"input_ids": ids(128), "attention_mask": torch.ones(1, 128, dtype=torch.long)}
    timed_generate(model, single, 2)
    t_one = timed_generate(model, single, 1)
    t_all = timed_generate(model, single, gen)
    decode_tps = (gen - 1) / (t_all - t_one)
    long = {"input_ids": ids(1000), "attention_mask": torch.ones(1, 1000, dtype=torch.long)}
    ttft = timed_generate(model, long, 1)
    aggregate = {}
    for width in (8,) if quick else (8, 16):
        batch = tok([f"Story {i}: " + words[: 64 * 6] for i in range(width)], return_tensors="pt", padding=True,
                    truncation=True, max_length=64)
        n = 32 if quick else 128
        aggregate[width] = width * n / timed_generate(model, dict(batch), n)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"decode_tps": decode_tps, "ttft_1000_s": ttft, "aggregate_tps": aggregate, "peak_rss_mib": rss}))


if __name__ == "__main__":
    main()
