"""Issue 27 point 3 on a tiny Llama whose fused q/k/v mixes stored quant types, as Qwen2.5's Q4_K_M
does (Q4_K q/k, Q6_K v): the fused linear keeps both as int8 codes with a scale and a low per group
of 16, the native decode step runs it and agrees with the eager step and a float32 reference of the
very weights, and a prompt's logits are the same bits cold, chunked and after a cached prefix."""

from __future__ import annotations

import copy

import pytest
import torch

from mlxcel.engine.decode_step import DecodeRow, DecodeStep
from mlxcel.engine.kv.tensors import KVCache
from mlxcel.layers import paged_attention
from mlxcel.layers.attention import AttentionContext, SequenceSlice
from mlxcel.layers.quant import Int4Levels, Int8Levels, QuantLinear, int6_codes, int8_blocks, quantize
from mlxcel.models import llama

from .conftest import random_llama

BLOCK = 16
Q6_GROUP = 16  # Q6_K: a scale per 16 weights, codes -32..31

pytestmark = pytest.mark.skipif(not paged_attention.available(), reason="no C++ compiler for the CPU kernels")


def k_quant(values: torch.Tensor, per: int, top: int, lowest: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Group scales [N, G] as a K-quant stores them: a float16 unit per `per` groups (256 inputs) times an
    integer in lowest..top per group -> (the scales so stored, the units [N, G / per, 1]); as they are,
    with no units, where the inputs are not whole superblocks."""
    n, groups = values.shape
    if groups % per:
        return values, None
    sub = values.view(n, groups // per, per)
    unit = (sub.abs().amax(-1, keepdim=True) / top).half().float().clamp(min=2**-14)
    if lowest == 0 and bool((sub <= 0).all()):  # lows: -dmin times a 6-bit min
        unit = -unit
    return (unit * torch.round(sub / unit).clamp(lowest, top)).view(n, groups), unit


def q4_levels(w: torch.Tensor) -> Int4Levels:
    """`w` on a 4-bit grid per group of 32 as Q4_K stores it: w ~ low + q * step, steps and lows integer
    multiples (0..63) of float16 units per 256 inputs."""
    n, k = w.shape
    groups = w.view(n, k // 32, 32)
    step, step_unit = k_quant((groups.amax(-1) - groups.amin(-1)) / 15, 8, 63, 0)
    low, low_unit = k_quant(groups.amin(-1).clamp(max=0), 8, 63, 0)
    q = torch.round((groups - low[..., None]) / step[..., None].clamp(min=1e-12)).clamp(0, 15)
    units = None if step_unit is None or low_unit is None else torch.cat((step_unit, low_unit), -1)
    return Int4Levels(q.to(torch.uint8).view(n, k), step, low, units)


def q6_levels(w: torch.Tensor) -> Int8Levels:
    """`w` as 6-bit codes with a scale per group of 16 as Q6_K stores it: w ~ code * scale, the scales
    int8 multiples of float16 units per 256 inputs."""
    n, k = w.shape
    groups = w.view(n, k // Q6_GROUP, Q6_GROUP)
    scale, unit = k_quant(groups.abs().amax(-1) / 31, Q6_GROUP, 127, -128)
    codes = torch.round(groups / scale[..., None].clamp(min=1e-12)).clamp(-32, 31)
    return Int8Levels(codes.to(torch.int8).view(n, k), scale, None, unit)


class MixedWeights:
    """What a Q4_K_M GGUF says it stores (`layers.quant.PackedWeights`): v_proj in 6-bit codes, every
    other linear on a 4-bit grid; the model's float weights are set to exactly those values."""

    def __init__(self, model: llama.Model) -> None:
        self.levels: dict[str, Int4Levels | Int8Levels] = {}
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                stored = q6_levels(module.weight.detach()) if name.endswith("v_proj") else q4_levels(module.weight.detach())
                module.weight.data = stored.dequantize()
                self.levels[f"{name}.weight"] = stored

    def int4_levels(self, name: str) -> Int4Levels | None:
        stored = self.levels.get(name)
        return stored if isinstance(stored, Int4Levels) else None

    def int8_levels(self, name: str) -> Int8Levels | None:
        stored = self.levels.get(name)
        return stored if isinstance(stored, Int8Levels) else None


@pytest.fixture(scope="module")
def models() -> tuple[llama.Model, llama.Model]:
    """(the quantized model, a float32 copy of the same weights)."""
    model = random_llama(27, hidden_size=256, num_layers=3, std=0.15)  # K = 256: whole superblocks
    model.packed_weights = MixedWeights(model)  # type: ignore[attr-defined]
    reference = copy.deepcopy(model)
    quantize(model)
    return model, reference


def prefill(model: llama.Model, cache: KVCache, prompt: list[int], table: tuple[int, ...],
            chunks: list[int]) -> torch.Tensor:
    """`prompt` written into `cache` in chunks of the given sizes (the last takes the rest) -> the last
    chunk's logits."""
    done = 0
    for size in [*chunks, len(prompt)]:
        end = min(done + size, len(prompt)) if size else len(prompt)
        if end <= done:
            continue
        ctx = AttentionContext([SequenceSlice(0, end - done, end, 0, table)], cache, "cpu", prefill_only=True)
        hidden = model(torch.tensor(prompt[done:end]), torch.arange(done, end), ctx)
        done = end
    return model.compute_logits(hidden).float()


def test_mixed_qkv_is_kept_as_stored_int8_codes_with_lows(models: tuple[llama.Model, llama.Model]) -> None:
    model, reference = models
    fused = model.model.layers[0].self_attn.fused_q_k_v.linear
    assert fused.int8_kernel and fused.weight is None
    # Scales and lows per group of the smallest group (Q6_K's 16), as float32 units per 256 inputs and
    # int8 multiples (kernels/decode_layers.cpp `Scales`, Units): [blocks of 64, 1, 2, 64 floats + 16 x 64].
    assert fused.scale.dtype == torch.uint8 and fused.scale.shape[1:] == (1, 2, 4 * 64 + 256 // Q6_GROUP * 64)
    exact = torch.cat([reference.model.layers[0].self_attn.get_submodule(n).weight for n in ("q_proj", "k_proj", "v_proj")])
    x = torch.randn(3, 256)
    torch.testing.assert_close(fused(x), x @ exact.t(), atol=2e-5, rtol=1e-5)  # float32 rows: no rounding


def test_native_step_on_a_mixed_qkv_agrees_with_eager_and_the_float_weights(models: tuple[llama.Model, llama.Model]) -> None:
    model, reference = models
    prompts = [[11, 22, 33, 44, 55, 66, 77], [5, 9] * 20, list(range(4, 90))]
    steps = {}
    for mode in ("eager", "native"):
        cache = KVCache(3, 64, BLOCK, 2, 64, torch.float32, "cpu")
        steps[mode] = DecodeStep(model, cache, "cpu", mode=mode, max_rows=4, max_positions=512)
    assert steps["native"].mode == "native"
    batch = []
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            table = tuple(range(i * 8, (i + 1) * 8))
            for step in steps.values():
                prefill(model, step.kv_cache, prompt[:-1], table, [])
            batch.append(DecodeRow(prompt[-1], len(prompt) - 1, 0, table))
        eager, native = steps["eager"].run(batch), steps["native"].run(batch)
        floats = torch.stack([reference.compute_logits(reference(
            torch.tensor(p), torch.arange(len(p)), AttentionContext([SequenceSlice(0, len(p), len(p))]))[-1]) for p in prompts])
    torch.testing.assert_close(native, eager, atol=2e-3, rtol=1e-3)  # the same kernels, norms summed in another order
    assert torch.equal(native.argmax(-1), floats.argmax(-1)) and torch.equal(eager.argmax(-1), floats.argmax(-1))
    # the 4-bit linears round activations to int8 per group of 32: close to the float32 model, not equal
    torch.testing.assert_close(eager, floats, atol=0.1, rtol=0.02)


def test_6bit_codes_give_the_int8_codes_bits_through_the_native_step(models: tuple[llama.Model, llama.Model]) -> None:
    """Issue 27 point 3 (speed): the fused q/k/v's codes (Q4_K levels 0..15 with Q6_K's -32..31) are kept in 6
    bits, and the native decode step and the eager one give the very bits of the same model with its codes
    as int8 (the form decode read before: a byte a weight)."""
    model, _ = models
    packed = [m for m in model.modules() if isinstance(m, QuantLinear) and m.qweight.dtype == torch.int32]
    assert len(packed) == 3  # each layer's q/k/v
    as_int8 = copy.deepcopy(model)
    for linear in as_int8.modules():
        if isinstance(linear, QuantLinear) and linear.qweight.dtype == torch.int32:
            linear.qweight = int8_blocks(int6_codes(linear.qweight))
    prompts = [[11, 22, 33, 44, 55, 66, 77], [5, 9] * 20, list(range(4, 90))]
    logits = {}
    with torch.inference_mode():
        for name, variant in (("6-bit", model), ("int8", as_int8)):
            for mode in ("native", "eager"):
                step = DecodeStep(variant, KVCache(3, 64, BLOCK, 2, 64, torch.float32, "cpu"), "cpu", mode=mode,
                                  max_rows=4, max_positions=512)
                batch = []
                for i, prompt in enumerate(prompts):
                    table = tuple(range(i * 8, (i + 1) * 8))
                    prefill(variant, step.kv_cache, prompt[:-1], table, [20])
                    batch.append(DecodeRow(prompt[-1], len(prompt) - 1, 0, table))
                logits[name, mode] = step.run(batch)
    for mode in ("native", "eager"):
        assert torch.equal(logits["6-bit", mode], logits["int8", mode]), mode


@pytest.mark.parametrize(("length", "cached"), [(65, 64), (67, 64), (67, 48), (50, 48), (50, 16)])
def test_a_prompts_logits_are_the_same_cold_chunked_and_after_a_cached_prefix(
        models: tuple[llama.Model, llama.Model], length: int, cached: int) -> None:
    """The tail after a prefix hit (the cold run's cached blocks, then 1 to 34 rows) and a chunked
    prefill give the cold run's bits."""
    model, _ = models
    prompt = [(7 * i + 3) % 90 + 4 for i in range(length)]
    cache = KVCache(3, 32, BLOCK, 2, 64, torch.bfloat16, "cpu")
    cold_table, hit_table = tuple(range(0, 5)), tuple(range(10, 15))
    with torch.inference_mode():
        cold = prefill(model, cache, prompt, cold_table, [])
        chunked = prefill(model, cache, prompt, tuple(range(5, 10)), [20, 20])
        for layer in cache.k + cache.v:  # the hit's table starts with the cold run's blocks' contents
            for src, dst in zip(cold_table[:cached // BLOCK], hit_table):
                layer[dst * BLOCK:(dst + 1) * BLOCK] = layer[src * BLOCK:(src + 1) * BLOCK]
        ctx = AttentionContext([SequenceSlice(0, length - cached, length, 0, hit_table)], cache, "cpu",
                               prefill_only=True)
        hit = model.compute_logits(model(torch.tensor(prompt[cached:]), torch.arange(cached, length), ctx)).float()
    assert torch.equal(hit, cold[cached:]), (hit - cold[cached:]).abs().max()
    assert torch.equal(chunked, cold[-chunked.shape[0]:])
