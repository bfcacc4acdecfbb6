"""CPU mixture-of-experts benchmark beside llama-server (issue 40): a random-weight Qwen3-MoE of a real
layer shape, converted by llama.cpp's own convert_hf_to_gguf.py and quantized by its llama-quantize,
served by mlxcel and by llama-server over HTTP; sampled requests (temperature 0.8, top_p 0.95), decode
at 1 stream and aggregate output at 8 (bench/run.py's `--decode-only` figures, its client and report).

Default shape (the issue's): 24 layers, hidden 2048, 64 experts, top-8, expert width 768, 16 query
heads / 4 KV heads of 128, SmolLM2's tokenizer (49,152 tokens): about 7.4B parameters, 1.2B active a
token. The checkpoint is written in bfloat16 one layer at a time (one safetensors shard a layer: never
a whole model in memory), with per-expert tensor names as Qwen3-30B-A3B's hub checkpoint has them.

    .venv/bin/python bench/moe_side_by_side.py                       # the full shape (a quiet machine)
    .venv/bin/python bench/moe_side_by_side.py --layers 2 --hidden 256 --experts 8 --top-k 2 \\
        --expert-width 128 --heads 4 --kv-heads 2 --head-dim 64 --quick  # a smoke run of the script

The llama.cpp source (its converter) and build tree (llama-server, llama-quantize) are
/tmp/llama-server/src and /tmp/llama-server/build by default (`../shared/tools/build-llama-server`;
`cmake --build BUILD --target llama-quantize` adds the quantizer). Files go to --work (kept between
runs: a second run with the same shape reuses the GGUF).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run  # noqa: E402
from run import (  # noqa: E402
    GREEDY, LLAMA_SERVER, SAMPLED, Figures, free_port, llama_server_cmd, mlxcel_cmd, model_path, print_report,
    run_server_peer,
)

from mlxcel.loading.gguf import GGUFFile  # noqa: E402
from mlxcel.text.tokenizer import Tokenizer  # noqa: E402

LLAMA_CPP = Path(os.environ.get("MLXCEL_BENCH_LLAMA_CPP", "/tmp/llama-server/src"))
LLAMA_BUILD = Path(os.environ.get("MLXCEL_BENCH_LLAMA_BUILD", "/tmp/llama-server/build"))
# transformers 5 swaps in Qwen2's tokenizer class for Qwen model types whatever tokenizer_config.json says;
# the converter's pre-tokenizer check then fails on SmolLM2's vocabulary (as tests/models/test_gguf_families.py).
_RUN_CONVERTER = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
from transformers.models.auto import tokenization_auto
tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.difference_update({"qwen2", "qwen3", "qwen3_moe"})
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def shape_config(args: argparse.Namespace, vocab_size: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": vocab_size,
        "hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "intermediate_size": 3 * args.expert_width,
        "moe_intermediate_size": args.expert_width, "num_experts": args.experts,
        "num_experts_per_tok": args.top_k, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2,
    }


def write_checkpoint(folder: Path, config: dict, tokenizer: Tokenizer, seed: int) -> None:
    """Random bfloat16 weights, a shard a layer (std 0.02; norms 1), with an index, config and tokenizer."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    hidden, heads, kv, dim = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], \
        config["head_dim"]
    width, experts = config["moe_intermediate_size"], config["num_experts"]

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    weight_map: dict[str, str] = {}

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    shard("model-embed.safetensors", {"model.embed_tokens.weight": rand(config["vocab_size"], hidden),
                                "lm_head.weight": rand(config["vocab_size"], hidden), "model.norm.weight": ones(hidden)})
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = {p + "input_layernorm.weight": ones(hidden), p + "post_attention_layernorm.weight": ones(hidden),
                 p + "self_attn.q_proj.weight": rand(heads * dim, hidden),
                 p + "self_attn.k_proj.weight": rand(kv * dim, hidden),
                 p + "self_attn.v_proj.weight": rand(kv * dim, hidden),
                 p + "self_attn.o_proj.weight": rand(hidden, heads * dim),
                 p + "self_attn.q_norm.weight": ones(dim), p + "self_attn.k_norm.weight": ones(dim),
                 p + "mlp.gate.weight": rand(experts, hidden)}
        for e in range(experts):
            layer[f"{p}mlp.experts.{e}.gate_proj.weight"] = rand(width, hidden)
            layer[f"{p}mlp.experts.{e}.up_proj.weight"] = rand(width, hidden)
            layer[f"{p}mlp.experts.{e}.down_proj.weight"] = rand(hidden, width)
        shard(f"model-layer-{i:03d}.safetensors", layer)
        del layer
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "TokenizersBackend", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))


def convert(folder: Path, out: Path) -> None:
    subprocess.run([sys.executable, "-c", _RUN_CONVERTER, str(LLAMA_CPP), str(folder), "--outtype", "bf16",
                    "--outfile", str(out)], check=True)


def quantize(source: Path, out: Path, kind: str, threads: int) -> None:
    binary = LLAMA_BUILD / "bin" / "llama-quantize"
    if not binary.exists():
        sys.exit(f"no {binary}: build it with `cmake --build {LLAMA_BUILD} --target llama-quantize`")
    subprocess.run([str(binary), str(source), str(out), kind, str(threads)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--quant", default="Q4_K_M", help="llama-quantize type (default Q4_K_M)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peers", default="mlxcel,llamaserver")
    parser.add_argument("--work", type=Path, default=Path("/tmp/mlxcel-moe-bench"),
                        help="where the checkpoint and GGUFs go (reused when the shape matches)")
    parser.add_argument("--quick", action="store_true", help="shorter runs (smoke test of the bench)")
    parser.add_argument("--greedy", action="store_true", help="greedy requests (default: sampled)")
    parser.add_argument("--llama-server-args", default="")
    parser.add_argument("--ready-timeout", type=float, default=1800.0,
                        help="seconds a server may take to start (mlxcel compiles its MoE decode step at start)")
    args = parser.parse_args()

    tokenizer = Tokenizer.from_gguf(GGUFFile(model_path(None)).metadata)  # SmolLM2's, from the packaged GGUF
    config = shape_config(args, tokenizer.backend.get_vocab_size())
    tag = (f"qwen3moe-L{args.layers}-H{args.hidden}-E{args.experts}x{args.top_k}-W{args.expert_width}"
           f"-A{args.heads}x{args.kv_heads}x{args.head_dim}")
    folder, work = args.work / tag, args.work
    gguf_bf16, gguf_q = work / f"{tag}-bf16.gguf", work / f"{tag}-{args.quant}.gguf"
    if not gguf_q.exists():
        if not gguf_bf16.exists():
            print(f"writing {folder}", file=sys.stderr, flush=True)
            write_checkpoint(folder, config, tokenizer, seed=0)
            convert(folder, gguf_bf16)
        quantize(gguf_bf16, gguf_q, args.quant, args.threads)
    experts = args.layers * args.experts * 3 * args.hidden * args.expert_width
    active = args.layers * (args.top_k * 3 * args.hidden * args.expert_width
                            + 2 * args.hidden * (args.heads + args.kv_heads) * args.head_dim)
    print(f"model: {gguf_q} ({gguf_q.stat().st_size / 2**30:.2f} GiB; {experts / 1e9:.3f}B expert parameters, "
          f"{active / 1e9:.3f}B active in the layers a token)", file=sys.stderr, flush=True)

    run.READY_TIMEOUT = args.ready_timeout
    shape = {"ignore_eos": True, **(GREEDY if args.greedy else SAMPLED)}
    results: dict[str, Figures] = {}
    for peer in args.peers.split(","):
        port = free_port()
        print(f"== {peer}", file=sys.stderr, flush=True)
        if peer == "mlxcel":
            cmd = mlxcel_cmd(gguf_q, port, args.threads)
        elif peer == "llamaserver":
            cmd = llama_server_cmd(LLAMA_SERVER, gguf_q, port, args.threads, args.llama_server_args)
        else:
            sys.exit(f"unknown peer {peer!r} (mlxcel, llamaserver)")
        results[peer] = (run_server_peer(peer, cmd, port, tokenizer, shape, args.quick, decode_only=True) if cmd
                         else Figures(note=f"skipped: no llama-server at {LLAMA_SERVER}"))
    print(f"{tag} {args.quant}, {args.threads} threads, {'greedy' if args.greedy else 'sampled'} requests")
    print_report(results)


if __name__ == "__main__":
    main()
