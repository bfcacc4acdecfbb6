"""GGUF loading per family (A2): a tiny random HF model written as llama.cpp's converter writes
it (llama q/k row permutation, Gemma's (1 + w) norms, llama3 rope as a `rope_freqs` tensor,
Gemma's fixed sliding pattern and local rope theta) loads back to the same logits (<= 2e-5)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import transformers

from mlxcel.loading import load_model
from mlxcel.loading.checkpoint import GGUF_ARCHITECTURES

from .harness import save_tiny_hf, uncached_logits, write_tiny_gguf
from .test_families import COMMON, LLAMA3_ROPE, PROMPTS, TOL_VS_TRANSFORMERS, reference_logits

# GGUF architecture -> a config that GGUF metadata can express in full.
GGUF_FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, rope_scaling=LLAMA3_ROPE),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32),
    # llama.cpp's qwen3moe: experts stacked as ffn_{gate,up,down}_exps, the router as ffn_gate_inp.
    "qwen3moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 6}, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
        rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


@pytest.mark.parametrize("arch", list(GGUF_FAMILIES))
def test_a2_tiny_gguf_loads_to_the_reference_logits(arch: str, tmp_path: Path) -> None:
    reference = save_tiny_hf(GGUF_FAMILIES[arch](), tmp_path / "hf")
    loaded = load_model(write_tiny_gguf(reference, arch, tmp_path / f"{arch}.gguf"))
    assert loaded.model_type == GGUF_ARCHITECTURES.get(arch, arch)  # llama.cpp's qwen3moe is qwen3_moe
    for prompt in PROMPTS:
        torch.testing.assert_close(uncached_logits(loaded.model, prompt), reference_logits(reference, prompt),
                                   atol=TOL_VS_TRANSFORMERS, rtol=0)


def test_llama3_rope_freqs_tensor_equals_the_llama3_formula() -> None:
    from mlxcel.layers.rope import rope_inv_freq

    from .harness import llama3_freq_factors

    factors = llama3_freq_factors(LLAMA3_ROPE, 16, 10000.0).tolist()
    torch.testing.assert_close(rope_inv_freq(16, 10000.0, {"rope_type": "freq_factors", "factors": factors}),
                               rope_inv_freq(16, 10000.0, LLAMA3_ROPE), atol=0, rtol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # q/k rows permuted in the file; a tied head
def test_issue11_a_4bit_gguf_is_packed_from_its_stored_levels_one_linear_at_a_time(arch: str, tmp_path: Path) -> None:
    """Issue 11 points 5 and 7: the CPU decode rewrite packs a Q4_0 checkpoint's linears, head and
    embedding from the levels as stored (Llama's q/k un-permutation applied to them), reading each
    linear only as it packs it: nothing of a replaced linear is left to read, and the result is the
    same bits whether the model was loaded lazily or eagerly, and near the float model's logits."""
    from mlxcel.layers.quant import QuantEmbedding, QuantLinear, quantize
    from mlxcel.loading.lazy import materialize_all

    from .harness import batch_uncached_logits

    reference = save_tiny_hf(GGUF_FAMILIES[arch](), tmp_path / "hf")
    path = write_tiny_gguf(reference, arch, tmp_path / f"{arch}.gguf", quant_type="Q4_0")
    dequantized = load_model(path).model  # the float values the file holds
    lazy, eager = load_model(path, lazy=True).model, load_model(path).model
    summary = quantize(lazy)
    assert lazy.lazy_weights.num_pending == 2 * 2 + 1  # only the norms are left to read
    materialize_all(lazy)
    assert summary.num_int8 == 0 and summary.num_int4 == sum(isinstance(m, QuantLinear) for m in lazy.modules())
    assert isinstance(lazy.model.embed_tokens, QuantEmbedding)
    ids = torch.tensor(PROMPTS[2])
    assert torch.equal(lazy.model.embed_tokens(ids), dequantized.model.embed_tokens(ids))  # the stored values
    quantize(eager)
    float_logits = batch_uncached_logits(dequantized, PROMPTS)
    for packed in (lazy, eager):
        got = batch_uncached_logits(packed, PROMPTS)
        for g, f in zip(got, float_logits):
            assert (g - f).abs().max() < 0.05 * f.abs().max()  # int8 activations: close, not equal
    assert all(torch.equal(a, b) for a, b in zip(batch_uncached_logits(lazy, PROMPTS),
                                                 batch_uncached_logits(eager, PROMPTS)))
