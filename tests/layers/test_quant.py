"""The int8 rewrite of a finished model (layers/quant.py): accuracy, fusion and the output head."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mlxcel.layers.quant import FusedInt8Linear, FusedOutput, Int8Head, Int8Linear, can_quantize_int8, quantize_int8

pytestmark = pytest.mark.skipif(not can_quantize_int8(), reason="no int8 weight-only kernel in this torch build")


def test_int8_linear_is_close_to_the_float_linear_on_both_paths() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 96)
    q = Int8Linear(lin.weight, lin.bias)
    for rows in (1, 3, 8, 40):  # below and above the int8/bf16 switch
        x = torch.randn(rows, 64)
        ref = lin(x)
        assert q(x).dtype == torch.float32
        assert (q(x) - ref).abs().max() < 0.02 * ref.abs().max()


def test_fused_outputs_equal_their_own_slices_and_compute_once() -> None:
    torch.manual_seed(1)
    parts = [nn.Linear(32, n, bias=False) for n in (32, 8, 8)]
    fused = FusedInt8Linear(parts)
    outs = [FusedOutput(fused, i) for i in range(3)]
    x = torch.randn(2, 32)
    whole = fused.linear(x)
    got = [o(x) for o in outs]
    assert [g.shape[-1] for g in got] == [32, 8, 8]
    assert torch.equal(torch.cat(got, dim=-1), whole)
    assert got[1].data_ptr() == got[0].data_ptr() + 32 * whole.element_size()  # views of one matmul
    y = torch.randn(2, 32)  # a new input tensor is recomputed, not served from the old one
    assert not torch.equal(outs[0](y), got[0])


def test_head_ranks_its_top_candidates_in_float32() -> None:
    """bfloat16 logits tie at ~0.125 resolution; the refined top must equal float32 math."""
    torch.manual_seed(2)
    weight = torch.randn(1000, 64)
    head = Int8Head(weight, num_refined=8)
    hidden = torch.randn(3, 64) * 4
    logits = head(hidden)
    exact = hidden @ head.linear.weight.float().t()  # bf16-stored weights, float32 accumulation
    refined = logits.topk(8, dim=-1).indices
    assert torch.allclose(logits.gather(1, refined), exact.gather(1, refined), atol=1e-4)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))


def test_quantize_rewrites_every_linear_and_a_tied_head() -> None:
    from mlxcel.models import llama

    torch.manual_seed(3)
    args = llama.ModelArgs(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=96, vocab_size=50, tie_word_embeddings=True)
    model = llama.Model(args).eval()
    count = quantize_int8(model)
    assert count == 2 * 7 + 1  # 7 linears a layer (q/k/v and gate/up fused) plus the tied head
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, Int8Head)
