"""The decode step (issue 11): its inputs, eager vs compiled vs native, batch invariance, KV cache types.

The compiled tests build a tiny model, so inductor compiles one small layer (and the head)
once per session; the real-model check of the compiled path is tests/models/test_compiled_step.py.
"""

from __future__ import annotations

import pytest
import torch

from mlxcel.engine.decode_step import KEY_ALIGN, DecodeRow, DecodeStep, build_inputs
from mlxcel.engine.kv.tensors import KVCache
from mlxcel.layers.attention import AttentionContext, SequenceSlice
from mlxcel.layers.quant import quantize
from mlxcel.models import llama

from .conftest import random_llama

BLOCK = 4


@pytest.fixture(scope="module")
def model() -> llama.Model:
    m = random_llama(1, num_layers=3)
    quantize(m)
    return m


def kv_cache(dtype: torch.dtype = torch.float32, num_blocks: int = 512) -> KVCache:
    cache = KVCache(3, num_blocks, BLOCK, 2, 16, dtype, "cpu")
    torch.manual_seed(2)
    for t in cache.k + cache.v:
        t.normal_()  # stale, finite content: only a row's own keys may matter
    return cache


def rows(lengths: list[int], blocks_per_row: int = 16) -> list[DecodeRow]:
    return [DecodeRow(5 + i, n - 1, 0, tuple(range(i * blocks_per_row, (i + 1) * blocks_per_row)))
            for i, n in enumerate(lengths)]


def test_build_inputs_pads_rows_and_keys_with_the_scratch_slot() -> None:
    inputs = build_inputs([DecodeRow(7, 5, 0, (3, 9)), DecodeRow(8, 1, 1, (4,))], BLOCK, scratch_slot=256,
                          num_rows=3)
    assert inputs.input_ids.tolist() == [7, 8, 0] and inputs.positions.tolist() == [5, 1, 0]
    assert inputs.slot_mapping.tolist() == [9 * 4 + 1, 4 * 4 + 1, 256]  # padding row -> scratch
    assert inputs.key_slots.shape == (3, KEY_ALIGN)
    assert inputs.key_slots[0, :6].tolist() == [12, 13, 14, 15, 36, 37]
    assert inputs.key_pos[0, :7].tolist() == [0, 1, 2, 3, 4, 5, -1]
    assert inputs.key_slots[1, :2].tolist() == [17, 256] and inputs.key_pos[1, :2].tolist() == [1, -1]
    assert (inputs.key_slots[2] == 256).all() and (inputs.key_pos[2] == -1).all()


def test_build_inputs_for_a_window_row_and_adapter_scales() -> None:
    """A row whose live keys start past 0 (--max-kv-size) maps each position through its own block
    table entry; rows without LoRA scales get the base model's zeros beside one that has them."""
    rows_ = [DecodeRow(3, 9, 6, (7, 2, 5), (0.5, 2.0)), DecodeRow(4, 2, 0, (1,))]
    inputs = build_inputs(rows_, 4, 99, num_adapters=2)
    assert inputs.key_pos[0, :5].tolist() == [6, 7, 8, 9, -1]
    assert inputs.key_slots[0, :5].tolist() == [2 * 4 + 2, 2 * 4 + 3, 5 * 4 + 0, 5 * 4 + 1, 99]
    assert inputs.slot_mapping.tolist() == [5 * 4 + 1, 1 * 4 + 2]
    assert inputs.key_slots[1, :4].tolist() == [4, 5, 6, 99]
    assert inputs.lora_scales.tolist() == [[0.5, 2.0], [0.0, 0.0]]


def test_build_inputs_sends_a_row_that_writes_no_kv_to_the_scratch_slot() -> None:
    """A prompt's last token whose KV is cached (issue 11) writes scratch, and still reads its own key."""
    inputs = build_inputs([DecodeRow(7, 5, 0, (3, 9), writes_kv=False), DecodeRow(8, 1, 0, (4,))], BLOCK,
                          scratch_slot=256)
    assert inputs.slot_mapping.tolist() == [256, 4 * 4 + 1]
    assert inputs.key_slots[0, :6].tolist() == [12, 13, 14, 15, 36, 37]


def test_eager_step_equals_the_uncached_forward(model: llama.Model) -> None:
    """Write a prompt's KV by prefill, then one decode step: logits equal a cache-free forward."""
    cache = kv_cache()
    step = DecodeStep(model, cache, "cpu", mode="eager", max_rows=4, max_positions=512)
    prompt = [11, 22, 33, 44, 55, 66, 77]
    table = (5, 2)
    with torch.inference_mode():
        ctx = AttentionContext([SequenceSlice(0, 6, 6, block_table=table)], cache, prefill_only=True)
        model(torch.tensor(prompt[:6]), torch.arange(6), ctx)
        logits = step.run([DecodeRow(prompt[6], 6, 0, table)])
        full = AttentionContext([SequenceSlice(0, 7, 7)], prefill_only=True)
        reference = model.compute_logits(model(torch.tensor(prompt), torch.arange(7), full)[-1:])
    # Decode rows use the int8 kernel, the reference's prefill rows bfloat16: close, not equal.
    torch.testing.assert_close(logits, reference.float(), atol=0.05, rtol=0.02)
    assert logits.argmax(-1).item() == reference.argmax(-1).item()


@pytest.mark.parametrize("mode", ["eager", "native", "compile"])
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(model: llama.Model, mode: str) -> None:
    """Issue 11 point 4: each row attends over its own keys only; padding adds exact zeros."""
    cache = kv_cache(torch.bfloat16)
    step = DecodeStep(model, cache, "cpu", mode=mode, max_rows=8, max_positions=512)
    batch = rows([9, 40, 3, 61, 130], 40)
    with torch.inference_mode():
        together = step.run(batch)
        for i, row in enumerate(batch):
            alone = step.run([row])
            assert torch.equal(alone[0], together[i]), f"row {i} differs alone and batched ({mode})"


def assert_same_tokens(step: DecodeStep, eager: DecodeStep, tolerance: float) -> None:
    """Batches of rows of many lengths: `step`'s logits within `tolerance` of the eager step's, same argmax."""
    with torch.inference_mode():
        for lengths in ([12], [5, 70, 33], [200, 1], [1, 2, 3, 4, 5, 6, 7, 250], [64]):
            a, b = eager.run(rows(lengths, 64)), step.run(rows(lengths, 64))
            torch.testing.assert_close(b, a, atol=tolerance, rtol=tolerance)
            assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_compiled_step_matches_eager(model: llama.Model, tmp_path) -> None:
    eager = DecodeStep(model, kv_cache(), "cpu", mode="eager", max_rows=8, max_positions=512)
    compiled = DecodeStep(model, kv_cache(), "cpu", mode="compile", max_rows=8, max_positions=512,
                          cache_dir=tmp_path)
    compiled.warm()  # from here on the compiled calls skip the guards that cannot differ
    assert_same_tokens(compiled, eager, tolerance=1e-4)
    # The KV each step wrote is the same too (the scratch slot aside: the compiled step's padding
    # row writes there, and nothing reads it).
    real = slice(0, compiled.kv_cache.scratch_slot)
    torch.testing.assert_close(compiled.kv_cache.k[2][real], eager.kv_cache.k[2][real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_step_matches_eager(model: llama.Model, dtype: torch.dtype) -> None:
    """The C++ layers (engine/native_step.py) against the same step op by op: logits and the KV
    each wrote agree to float rounding (the norms and RoPE sum in another order), tokens are equal."""
    eager = DecodeStep(model, kv_cache(dtype), "cpu", mode="eager", max_rows=8, max_positions=512)
    native = DecodeStep(model, kv_cache(dtype), "cpu", mode="native", max_rows=8, max_positions=512)
    assert native.mode == "native"
    assert_same_tokens(native, eager, tolerance=2e-2)
    real = slice(0, native.kv_cache.scratch_slot)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for layer in range(3):
        torch.testing.assert_close(native.kv_cache.k[layer][real], eager.kv_cache.k[layer][real], atol=tolerance,
                                   rtol=tolerance)
        torch.testing.assert_close(native.kv_cache.v[layer][real], eager.kv_cache.v[layer][real], atol=tolerance,
                                   rtol=tolerance)


def test_native_step_writes_only_its_rows_slots(model: llama.Model) -> None:
    """A row writes its one new key and value a layer, at its slot; nothing else of the cache moves."""
    cache = kv_cache()
    before = [t.clone() for t in cache.k + cache.v]
    step = DecodeStep(model, cache, "cpu", mode="native", max_rows=4, max_positions=512)
    with torch.inference_mode():
        step.run([DecodeRow(9, 5, 0, (3, 7)), DecodeRow(4, 0, 0, (8,))])
    for layer, old in zip(cache.k + cache.v, before):
        assert (layer != old).any(dim=(1, 2)).nonzero().flatten().tolist() == [7 * BLOCK + 1, 8 * BLOCK]  # position 5: block 7


def test_native_step_falls_back_to_compile_where_the_model_is_not_native(model: llama.Model) -> None:
    """Quantized KV, plain (unquantized) linears and other families keep the torch.compile'd step."""
    from mlxcel.engine import native_step

    assert native_step.unsupported(model, kv_cache(), has_lora=False) is None
    q8 = KVCache(3, 64, BLOCK, 2, 32, torch.bfloat16, "cpu", k_type="q8_0", v_type="q8_0")
    assert "q8_0" in native_step.unsupported(model, q8, has_lora=False)
    assert "LoRA" in native_step.unsupported(model, kv_cache(), has_lora=True)
    plain = random_llama(1, num_layers=3)  # not quantized
    assert "packed" in native_step.unsupported(plain, kv_cache(), has_lora=False)
    step = DecodeStep(plain, kv_cache(), "cpu", mode="native", max_rows=4, max_positions=512)
    assert step.mode == "compile"


def test_native_op_refuses_inconsistent_inputs(model: llama.Model) -> None:
    """The C++ op checks what it reads: a slot outside the cache or a missing weight is a ValueError."""
    from mlxcel.engine.native_step import NativeLayers

    cache = kv_cache()
    layers = NativeLayers(model, cache)
    x, positions = torch.zeros(1, 64), torch.tensor([3])
    key_slots, key_pos = torch.tensor([[0, 1, 2, 3]]), torch.tensor([[0, 1, 2, 3]])
    with torch.inference_mode():
        layers(x, positions, torch.tensor([4]), key_slots, key_pos)  # consistent: runs
        with pytest.raises(ValueError, match="outside the cache"):
            layers(x, positions, torch.tensor([cache.scratch_slot + BLOCK]), key_slots, key_pos)
        layers.weights = layers.weights[:-1]
        with pytest.raises(ValueError, match="weights for 3 layers"):
            layers(x, positions, torch.tensor([4]), key_slots, key_pos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_cache_types_store_and_decode(model: llama.Model, dtype: torch.dtype) -> None:
    cache = kv_cache(dtype)
    step = DecodeStep(model, cache, "cpu", mode="eager", max_rows=2, max_positions=512)
    with torch.inference_mode():
        logits = step.run(rows([1]))
    slot = 0 * BLOCK  # position 0 of block 0
    assert cache.k[0].dtype == dtype and torch.isfinite(logits).all()
    assert not torch.isnan(cache.k[0][slot]).any()


def test_padding_rows_write_only_the_scratch_block(model: llama.Model) -> None:
    cache = kv_cache()
    before = [t.clone() for t in cache.k]
    inputs = build_inputs(rows([6]), BLOCK, cache.scratch_slot, num_rows=4)
    step = DecodeStep(model, cache, "cpu", mode="eager", max_rows=4, max_positions=512)
    with torch.inference_mode():
        step.forward(*inputs.tensors())
    for layer, old in zip(cache.k, before):
        changed = (layer != old).any(dim=(1, 2)).nonzero().flatten().tolist()
        assert changed == [5] or set(changed) - {5} <= set(range(cache.scratch_slot, cache.scratch_slot + BLOCK))
        assert 5 in changed  # the real row's new key (position 5 of block 0)
