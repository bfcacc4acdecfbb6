"""Issues 41 and 42 on CUDA (the lent GPU: `MLXCEL_TEST_DEVICE=cuda PYTHONPATH=src python3 -m pytest
tests/engine/test_cuda_hybrid_and_quantized.py`); skipped without CUDA.

- A hybrid's decode step captured as CUDA graphs (Gated DeltaNet, Mamba-2, LFM2's short conv, the RG-LRU, each
  beside attention) gives the eager step's greedy tokens, alone and in a batch.
- A quantized folder keeps its 4-bit levels (MLX affine, GPTQ) in torch's int4 GEMM and its per-channel FP8
  weights in `torch._scaled_mm`: logits near the dequantized model's, fewer resident bytes, and the
  captured decode step's greedy tokens equal the eager step's over the same kept weights.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from mlxcel.config import EngineConfig
from mlxcel.engine.client import EngineClient
from mlxcel.engine.loop import EngineCore, ModelShape
from mlxcel.layers.quant import resident_bytes
from mlxcel.layers.quant_cuda import Fp8CudaLinear, Int4CudaLinear, keep_quantized
from mlxcel.loading import load_model
from mlxcel.loading.lazy import materialize_all
from mlxcel.types import Request
from tests.engine.conftest import collect, greedy
from tests.loading.quant_writers import fp8_channel_linear, gptq_linear, mlx_affine_linear
from tests.models.harness import save_tiny_hf, uncached_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [[(i * 7 + n) % 120 + 3 for i in range(n)] for n in (5, 9, 14, 23)]
NUM_TOKENS = 16


def _engine(model: torch.nn.Module, decode_step: str, dtype: torch.dtype) -> EngineClient:
    config = EngineConfig(max_num_seqs=4, ctx_size=4 * 64, max_num_batched_tokens=32, block_size=4,
                          decode_step=decode_step)
    core = EngineCore(model, ModelShape.of(model.args), config, eos_token_ids=frozenset(), device="cuda", dtype=dtype)
    core.warm_decode_step()
    core.start()
    return EngineClient(core)


def _runs(client: EngineClient, tag: str) -> list[list[int]]:
    """Each prompt alone, then all of them at once; the greedy tokens of each run."""
    alone = [asyncio.run(collect(client, Request(f"{tag}{i}", p, greedy(NUM_TOKENS))))[0] for i, p in enumerate(PROMPTS)]

    async def together() -> list[list[int]]:
        runs = [collect(client, Request(f"{tag}b{i}", p, greedy(NUM_TOKENS))) for i, p in enumerate(PROMPTS)]
        return [tokens for tokens, _ in await asyncio.gather(*runs)]

    return alone + asyncio.run(together())


def _tokens_by_mode(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, list[list[int]]]:
    out = {}
    for mode in ("eager", "cuda-graph"):
        client = _engine(model, mode, dtype)
        try:
            step = client.core.runner.decode_step
            assert step.mode == mode
            out[mode] = _runs(client, mode)
            if mode == "cuda-graph":
                assert step._graphs is not None and step._graphs._graphs  # replayed, not run eagerly
        finally:
            client.core.stop(10)
    return out


# ---- issue 41: the hybrid decode step under CUDA graphs ----

def _qwen3_5_config():  # noqa: ANN202
    import transformers

    return transformers.Qwen3_5TextConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=128, max_position_embeddings=512, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"] * 2)


# Gated DeltaNet (Qwen3.5), Mamba-2 (Nemotron-H), LFM2's short conv and the RG-LRU: each mixer's decode form captured.
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "lfm2", "recurrent_gemma"])
def test_hybrid_decode_step_as_cuda_graphs_gives_the_eager_steps_tokens(family: str, tmp_path: Path) -> None:
    from tests.models.test_hybrid_families import FAMILIES

    save_tiny_hf(_qwen3_5_config() if family == "qwen3_5" else FAMILIES[family][1](), tmp_path)
    model = load_model(tmp_path, device="cuda", dtype=torch.float32).model
    tokens = _tokens_by_mode(model, torch.float32)
    assert all(len(t) == NUM_TOKENS for t in tokens["eager"])
    assert tokens["cuda-graph"] == tokens["eager"]
    assert tokens["eager"][:len(PROMPTS)] == tokens["eager"][len(PROMPTS):]  # alone == batched


# ---- issue 42: 4-bit and FP8 weights kept as stored ----

def _tiny_quantized(folder: Path, kind: str) -> Path:
    """A tiny random qwen3 (hidden 64: tinygemm's K multiple of 64) with every projection stored as `kind`."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    hf = folder / "hf"
    config = AutoConfig.for_model("qwen3", vocab_size=128, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=512, tie_word_embeddings=True)
    save_tiny_hf(config, hf)
    writers = {"mlx-4bit-g64": (lambda w: mlx_affine_linear(w, 4, 64), {"quantization": {"group_size": 64, "bits": 4}}),
               "gptq-4bit-g32": (lambda w: gptq_linear(w, 4, 32, False), {"quantization_config": {
                   "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False}}),
               "fp8-channel": (fp8_channel_linear, {"quantization_config": {
                   "quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
                       "targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}}})}
    write, block = writers[kind]
    stored = {}
    for name, value in load_file(str(hf / "model.safetensors")).items():
        if name.endswith("proj.weight"):
            tensors, _ = write(value)
            stored |= {name.replace(".weight", f".{part}"): t for part, t in tensors.items()}
        else:
            stored[name] = value
    out = folder / kind
    out.mkdir()
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**json.loads((hf / "config.json").read_text()), **block}))
    return out


@pytest.mark.parametrize("kind", ["mlx-4bit-g64", "gptq-4bit-g32", "fp8-channel"])
def test_quantized_folder_kept_quantized_on_cuda(kind: str, tmp_path: Path) -> None:
    folder = _tiny_quantized(tmp_path, kind)
    # float32 around the kept matmuls: the reference is the dequantized weights exactly, and the captured step
    # (its layers compiled) rounds no differently from the eager one
    dense = load_model(folder, device="cuda", dtype=torch.float32).model
    kept = load_model(folder, device="cuda", dtype=torch.float32, lazy=True).model
    summary = keep_quantized(kept, "cuda")
    materialize_all(kept)
    module = Fp8CudaLinear if kind.startswith("fp8") else Int4CudaLinear
    assert summary.num_bf16 == 0 and sum(isinstance(m, module) for m in kept.modules()) == 2 * 4  # qkv, o, gate_up, down
    if module is Int4CudaLinear:
        assert {m.group for m in kept.modules() if isinstance(m, module)} == {int(kind[-2:])}
    assert resident_bytes(kept) < resident_bytes(dense)
    with torch.inference_mode():
        want = uncached_logits(dense, PROMPTS[-1]).float()
        got = uncached_logits(kept, PROMPTS[-1]).float()
    error = float((got - want).norm() / want.norm())
    print(f"{kind}: relative logit error vs the dequantized weights {error:.4f}")
    assert error < (0.08 if kind.startswith("fp8") else 0.03)
    tokens = _tokens_by_mode(kept, torch.float32)
    assert tokens["cuda-graph"] == tokens["eager"]
