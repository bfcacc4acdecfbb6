"""Issue 40's GPU MoE figures, run on the lent GPU (see bench/RESULTS.md):

    PYTHONPATH=src python3 bench/gpu_moe.py [--out DIR] [--widths 1,16,64] [--small] [--family qwen3_5 --mode cuda-graph,eager]

A random-weight Qwen3-MoE of a real layer shape (24 layers, hidden 2048, 64 experts, top-8, expert width
768: about 7.6B parameters in all, 1.1B active a token) in bfloat16 on CUDA: our logits against transformers'
on the same weights, then the engine's aggregate tok/s with the decode step as CUDA graphs (the experts as one
`torch.nn.functional.grouped_mm` each for gate/up and down, captured with the rest of the step) at each width,
beside transformers' eager `generate` at the same widths. `--small` is a 4-layer, 8-expert shape for a smoke run.
`--family qwen3_5` is issue 41's hybrid instead: a Qwen3.5-style text model (hidden 2048, 24 layers, three Gated
DeltaNet layers to each gated-attention layer), its decode step captured as CUDA graphs too (`--mode
cuda-graph,eager` runs both on one model and checks their greedy tokens are the same).
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

from gpu_check import compare_logits, engine_runs, engine_speeds, hf_generate_speed, hf_model  # noqa: E402

MOE_SHAPE = dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                 intermediate_size=6144, moe_intermediate_size=768, num_experts=64, num_experts_per_tok=8,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
                 max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
SMALL = dict(MOE_SHAPE, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2)
HYBRID_SHAPE = dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                    intermediate_size=6144, vocab_size=151936, linear_num_value_heads=16, linear_num_key_heads=16,
                    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6, max_position_embeddings=32768,
                    rms_norm_eps=1e-6, tie_word_embeddings=False)
FAMILIES = {"qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", MOE_SHAPE, SMALL),
            "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", HYBRID_SHAPE,
                        dict(HYBRID_SHAPE, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"]))}


def random_model(folder: Path, family: str, shape: dict) -> Path:
    """The random checkpoint, made on the GPU in bfloat16 (no float32 copy of 7.6B parameters on the host)."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, FAMILIES[family][0])(**shape)
    config.initializer_range = 0.02
    with torch.device("cuda"):
        model = getattr(transformers, FAMILIES[family][1])(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return folder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("/tmp"))
    parser.add_argument("--widths", default="1,16,64")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--family", default="qwen3_moe", choices=list(FAMILIES))
    parser.add_argument("--mode", default="cuda-graph",
                        help="the engine's decode step (cuda-graph, eager), or several, comma-separated")
    args = parser.parse_args()
    from mlxcel.layers.quant import fuse_projections
    from mlxcel.loading import load_model

    widths = tuple(int(w) for w in args.widths.split(","))
    shape = FAMILIES[args.family][3 if args.small else 2]
    started = time.perf_counter()
    path = random_model(Path(f"/tmp/{args.family}-random"), args.family, shape)
    report: dict = {"device": torch.cuda.get_device_name(), "shape": shape,
                    "make_s": round(time.perf_counter() - started, 1)}
    started = time.perf_counter()
    loaded = load_model(path, device="cuda", dtype=torch.bfloat16)
    fuse_projections(loaded.model)  # as serving.served_model does on CUDA
    report["load_s"] = round(time.perf_counter() - started, 1)
    params = sum(p.numel() for p in loaded.model.parameters())
    report["params_b"] = round(params / 1e9, 2)
    ref = hf_model(path, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (5, 17, 64, 200)]
    report["logits_bf16"] = compare_logits(loaded.model, ref, prompts)
    print(json.dumps(report), flush=True)
    modes = args.mode.split(",")
    alone_by_mode = {}
    for mode in modes:
        speeds = engine_speeds(loaded, mode, widths, gen=args.gen)
        client = speeds.pop("client")
        alone = alone_by_mode[mode] = [asyncio.run(engine_runs(client, [p], 16))[0] for p in prompts]
        batched = asyncio.run(engine_runs(client, prompts, 16))
        client.core.stop()
        report[mode] = {**speeds, "greedy_16_alone_vs_batched_equal": [a == b for a, b in zip(alone, batched)]}
        print(json.dumps(report), flush=True)
    report["greedy_16_equal_across_modes"] = [len({str(alone_by_mode[m][i]) for m in modes}) == 1
                                              for i in range(len(prompts))]
    report["transformers_generate"] = {f"tok_s_batch_{w}": hf_generate_speed(ref, w, gen=args.gen) for w in widths}
    report["ratio_vs_transformers"] = {
        mode: {w: round(report[mode][f"tok_s_batch_{w}"] / report["transformers_generate"][f"tok_s_batch_{w}"], 2)
               for w in widths} for mode in modes}
    text = json.dumps(report, indent=1)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"gpu_{args.family}{'_small' if args.small else ''}.json").write_text(text)


if __name__ == "__main__":
    main()
