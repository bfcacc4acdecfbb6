"""Issue 42: a tiny llama GGUF whose matrices are in the types that were refused or widened (MXFP4, the
I-quants, the ternary types, Q5_K / Q3_K / Q2_K) loads; the CPU decode rewrite keeps every linear as its
stored codes on the int8 kernel (no float copy) with the logits of the widened (dequantized float) model
within float32 rounding; and the real HTTP server generates from it, with its weight format on /props and
/v1/models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from mlxcel.layers import paged_attention
from mlxcel.layers.quant import CodesEmbedding, QuantHead, QuantLinear, quantize
from mlxcel.loading import load_model
from mlxcel.loading.lazy import materialize_all
from tests.loading.tiny_checkpoint import random_gguf_blocks
from tests.text.conftest import tiny_byte_level_metadata

from .harness import batch_uncached_logits, greedy, uncached_hidden

HIDDEN, INTER, NUM_HEADS, NUM_KV_HEADS = 256, 512, 4, 2  # 256: whole superblocks along every input
# (layer, GGUF tensor) -> type: each new type on some linear, two layers.
LAYER_TYPES = (
    {"attn_q": "Q5_K", "attn_k": "Q3_K", "attn_v": "Q2_K", "attn_output": "IQ4_XS", "ffn_gate": "MXFP4",
     "ffn_up": "IQ4_NL", "ffn_down": "IQ3_S"},
    {"attn_q": "IQ2_XXS", "attn_k": "IQ2_XS", "attn_v": "IQ2_S", "attn_output": "IQ3_XXS", "ffn_gate": "TQ1_0",
     "ffn_up": "TQ2_0", "ffn_down": "MXFP4"},
)  # fmt: skip
PROMPTS = [[60, 61, 62, 63, 64], [100, 7, 200, 33], [5]]

needs_kernels = pytest.mark.skipif(not paged_attention.available(), reason="no C++ compiler for the CPU kernels")


def linear_shape(part: str) -> tuple[int, int]:
    kv = NUM_KV_HEADS * HIDDEN // NUM_HEADS
    return {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
            "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}[part]


def write_mixed_gguf(path: Path) -> Path:
    """The file as a converter plus llama-quantize would lay it out (norms F32), with the byte-level tokenizer."""
    metadata: dict[str, Any] = tiny_byte_level_metadata()
    vocab = len(metadata["tokenizer.ggml.tokens"])
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(len(LAYER_TYPES))
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model(metadata["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(metadata["tokenizer.ggml.pre"])
    writer.add_token_list(metadata["tokenizer.ggml.tokens"])
    writer.add_token_types(metadata["tokenizer.ggml.token_type"])
    writer.add_token_merges(metadata["tokenizer.ggml.merges"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(False)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", random_gguf_blocks("Q5_K", vocab, HIDDEN, 1, max_abs=1.0),
                      raw_dtype=gguf.GGMLQuantizationType.Q5_K)  # the tied head: 269 rows, not whole blocks of 64
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    for layer, types in enumerate(LAYER_TYPES):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        for seed, (part, type_name) in enumerate(types.items()):
            rows, cols = linear_shape(part)
            blocks = random_gguf_blocks(type_name, rows, cols, 10 * layer + seed, max_abs=0.25)
            writer.add_tensor(f"blk.{layer}.{part}.weight", blocks, raw_dtype=gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mixed_gguf(tmp_path_factory.mktemp("issue42") / "mixed.gguf")


@needs_kernels
def test_issue42_mixed_type_gguf_keeps_its_codes_and_the_widened_models_logits(mixed_gguf: Path) -> None:
    widened = load_model(mixed_gguf).model  # every tensor dequantized by the gguf package: the float reference
    packed = load_model(mixed_gguf, lazy=True).model
    summary = quantize(packed)
    materialize_all(packed)  # the rest (norms, rope tables), as the serving runtime does after the rewrite
    linears = [m for name, m in packed.named_modules() if isinstance(m, QuantLinear) and "layers." in name]
    assert linears and summary.num_int4 == 0
    # q/k/v and gate/up are fused (mixed types stack as codes with lows); each kept once, as stored codes
    assert all(m.int8_kernel and m.weight is None and m.scale.dim() >= 3 for m in linears)
    assert isinstance(packed.lm_head, QuantHead)  # 269 rows: the widened path (per-row int8 + bfloat16 refine)
    assert isinstance(packed.model.embed_tokens, CodesEmbedding)  # the Q5_K table as codes, scales and lows
    ids = torch.tensor([PROMPTS[0], PROMPTS[0][::-1]])
    assert torch.equal(packed.model.embed_tokens(ids), widened.model.embed_tokens(ids))  # the file's values
    got, want = batch_uncached_logits(packed, PROMPTS), batch_uncached_logits(widened, PROMPTS)
    for g, w in zip(got, want):
        assert torch.equal(g.argmax(-1), w.argmax(-1))
        assert float((g - w).abs().max()) < 0.02 * float(w.abs().max())  # the head's per-row int8 only
    # The layers alone (before the head): float32 rounding only.
    hidden_got, hidden_want = uncached_hidden(packed, PROMPTS[0]), uncached_hidden(widened, PROMPTS[0])
    torch.testing.assert_close(hidden_got, hidden_want, rtol=0, atol=2e-4 * float(hidden_want.abs().max()))
    assert greedy(packed, PROMPTS[0], 6) == greedy(widened, PROMPTS[0], 6)


def test_issue42_weights_info_names_the_types_and_bits(mixed_gguf: Path) -> None:
    loaded = load_model(mixed_gguf, lazy=True)
    summary = loaded.weights_info()
    types = summary["tensor_types"]
    assert summary["format"] == "gguf" and {t for layer in LAYER_TYPES for t in layer.values()} | {"F32"} == set(types)
    assert types["MXFP4"]["tensors"] == 2 and types["MXFP4"]["weights"] == INTER * HIDDEN + HIDDEN * INTER
    assert types["MXFP4"]["bytes"] == types["MXFP4"]["weights"] // 32 * 17  # 4.25 bits a weight
    tensor_bytes = sum(e["bytes"] for e in types.values())
    assert summary["tensor_bytes"] == tensor_bytes and tensor_bytes < mixed_gguf.stat().st_size
    assert 2.0 < summary["bits_per_weight"] < 6.0
    assert "MXFP4 " in summary["description"] and "bits a weight" in summary["description"]
