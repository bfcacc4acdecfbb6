"""Issue 40: mixture-of-experts layers on the CPU decode kernels (layers/moe.py `QuantExperts`).

`quantize` packs an MoE's experts as it packs a dense linear: a GGUF's stored expert stacks (Q4_0 /
Q8_0 ffn_*_exps) as stored, a float checkpoint's experts to the dense path's forms. The reference is the
float model of the very values the file holds (its dequantized weights), so the only differences left
are the kernels' own: the 4-bit kernel's int8 rounding of the activations, per-channel int8 weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from mlxcel.layers import paged_attention
from mlxcel.layers.moe import QuantExperts
from mlxcel.layers.quant import quantize
from mlxcel.loading import load_model
from mlxcel.loading.lazy import materialize_all

from .harness import batch_uncached_logits, greedy, save_tiny_hf, uncached_logits, write_tiny_gguf
from .test_families import COMMON, PROMPTS

pytestmark = pytest.mark.skipif(not paged_attention.available(), reason="the CPU kernels did not build")


def _qwen3_moe() -> transformers.PretrainedConfig:
    # Hidden 64 (two 4-bit groups), 8 experts of width 32, top-2: each prompt hits most experts.
    return transformers.Qwen3MoeConfig(**COMMON, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                       moe_intermediate_size=32, norm_topk_prob=True)


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3moe")
    reference = save_tiny_hf(_qwen3_moe(), folder / "hf")
    return write_tiny_gguf(reference, "qwen3moe", folder / "q4.gguf", quant_type="Q4_0")


def _experts(model: torch.nn.Module) -> list[QuantExperts]:
    return [m for m in model.modules() if isinstance(m, QuantExperts)]


def _close(got: list[torch.Tensor], want: list[torch.Tensor], fraction: float) -> None:
    for g, w in zip(got, want):
        assert (g - w).abs().max() < fraction * w.abs().max()


def test_issue40_q4_gguf_experts_are_packed_from_their_stored_levels(q4_gguf: Path) -> None:
    dequantized = load_model(q4_gguf).model  # the float values the file holds
    lazy = load_model(q4_gguf, lazy=True).model
    summary = quantize(lazy)
    materialize_all(lazy)  # the norms, routers and attention: the experts were packed as read
    experts = _experts(lazy)
    assert len(experts) == 2 and summary.num_int8 == 0
    for block in experts:
        assert all(lin.bits == 4 and lin.weight is None for lin in [*block.gate_up, *block.down])
        assert len(block.gate_up) == 8 and block.gate_up[0].out_features == 64 and block.down[0].in_features == 32
    # Expert 3 of layer 1 holds exactly the file's values (levels kept, nothing rounded twice).
    x = torch.randn(5, 64)
    float_experts = dequantized.model.layers[1].mlp.experts
    want = torch.nn.functional.linear(x, float_experts.gate_up_proj[3])
    got = torch.ops.mlxcel.int4_linear(x, experts[1].gate_up[3].qweight, experts[1].gate_up[3].scale)
    assert (got - want).abs().max() < 0.02 * want.abs().max()  # the activations' int8 rounding only
    _close(batch_uncached_logits(lazy, PROMPTS), batch_uncached_logits(dequantized, PROMPTS), 0.05)


def test_issue40_packed_experts_run_each_chosen_expert_once_and_match_the_python_loop(q4_gguf: Path) -> None:
    """The C++ op equals the same loop over the same kernels in Python (a row's bits whatever the batch),
    and the float MoE op on the dequantized experts within the activations' rounding."""
    model = load_model(q4_gguf).model
    float_experts = model.model.layers[0].mlp.experts
    quantize(model)
    packed = _experts(model)[0]
    torch.manual_seed(1)
    x = torch.randn(7, 64)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(7)])
    weights = torch.rand(7, 2)
    fast = packed(x, ids, weights)
    loop = _python_loop(packed, x, ids, weights)
    torch.testing.assert_close(fast, loop, atol=1e-5, rtol=1e-5)
    alone = torch.cat([packed(x[i:i + 1], ids[i:i + 1], weights[i:i + 1]) for i in range(7)])
    assert torch.equal(alone, fast)  # grouping rows by expert leaves each row's bits alone
    reference = float_experts(x, ids, weights, path="per_expert")
    assert (fast - reference).abs().max() < 0.03 * reference.abs().max()


def _python_loop(packed: QuantExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    packed._on_kernels = False  # as where the CPU kernels do not build: the same loop in Python
    try:
        return packed(x, ids, weights)
    finally:
        packed._on_kernels = True


def test_issue40_float_moe_checkpoint_packs_experts_to_int8_near_the_float_logits(tmp_path: Path) -> None:
    """`--quantize auto` on a float checkpoint: the experts go per-channel int8 (no 4-bit grid in them),
    without a bfloat16 copy; logits stay near the float model's."""
    save_tiny_hf(_qwen3_moe(), tmp_path)
    reference = load_model(tmp_path).model
    model = load_model(tmp_path, lazy=True).model
    quantize(model)
    materialize_all(model)
    experts = _experts(model)
    assert experts and all(lin.bits == 8 and lin.weight is None for e in experts for lin in [*e.gate_up, *e.down])
    _close(batch_uncached_logits(model, PROMPTS), batch_uncached_logits(reference, PROMPTS), 0.05)


def test_issue40_q8_gguf_moe_greedy_tokens_equal_the_float_reference(tmp_path: Path) -> None:
    """Q8_0 experts kept as their stored codes on the int8 kernel: 16 greedy tokens through the paged
    cache (prefill, then a token a step) equal those of the float model of the file's values."""
    reference = save_tiny_hf(_qwen3_moe(), tmp_path / "hf")
    path = write_tiny_gguf(reference, "qwen3moe", tmp_path / "q8.gguf", quant_type="Q8_0")
    dequantized = load_model(path).model
    model = load_model(path, lazy=True).model
    quantize(model)
    materialize_all(model)
    assert all(lin.int8_kernel and lin.weight is None for e in _experts(model) for lin in [*e.gate_up, *e.down])
    for prompt in PROMPTS[1:3]:
        assert greedy(model, prompt, 16) == greedy(dequantized, prompt, 16)
    torch.testing.assert_close(uncached_logits(model, PROMPTS[0]), uncached_logits(dequantized, PROMPTS[0]),
                               atol=2e-5, rtol=0)  # int8 codes times float rows in float32: no rounding
