"""Issue 42: the GGUF types that were refused (MXFP4, IQ4_NL, IQ4_XS, IQ3_S, IQ3_XXS, IQ2_XXS/XS/S, TQ1_0,
TQ2_0) and the types that were widened (Q5_K, Q3_K, Q2_K, Q5_1). Each, written to a real GGUF file as random
blocks with sane float16 scales (every bit pattern of the codes is exercised), dequantizes equal to the
`gguf` package's reference; its stored codes, scales and lows give those values bit for bit; and the CPU
int8 kernel on the stored codes equals the float product of the dequantized weight within float32 rounding."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from mlxcel.layers import paged_attention
from mlxcel.layers.quant import Int8Levels, QuantLinear
from mlxcel.loading import ModelLoadError
from mlxcel.loading.gguf import SUPPORTED_TENSOR_TYPES, GGUFFile

from .tiny_checkpoint import GGUF_SCALE_FIELDS, random_gguf_blocks, write_gguf

Q = gguf.GGMLQuantizationType
ROWS, COLS = 128, 512  # whole blocks of 64 outputs for the int8 kernel; two 256-weight superblocks a row
NEW_TYPES = list(GGUF_SCALE_FIELDS)
# Group of a scale along a row, and the codes' bound (|code| <= bound; Q5_K / Q2_K: levels 0..bound with a low).
GROUPS = {"Q5_1": (32, 31), "Q5_K": (32, 31), "Q3_K": (16, 4), "Q2_K": (16, 3), "IQ4_NL": (32, 127), "IQ4_XS": (32, 127),
          "TQ1_0": (256, 2), "TQ2_0": (256, 2), "IQ2_XXS": (32, 43), "IQ2_XS": (16, 43), "IQ2_S": (16, 43),
          "IQ3_XXS": (32, 62), "IQ3_S": (32, 15), "MXFP4": (32, 12)}  # fmt: skip


def random_blocks(type_name: str, seed: int) -> np.ndarray:
    return random_gguf_blocks(type_name, ROWS, COLS, seed)


@pytest.fixture(scope="module")
def typed_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[GGUFFile, dict[str, np.ndarray]]:
    raws = {t: random_blocks(t, seed) for seed, t in enumerate(NEW_TYPES)}
    path = write_gguf(tmp_path_factory.mktemp("issue42") / "types.gguf", "llama",
                      {f"{t.lower()}.weight": (raw, Q[t]) for t, raw in raws.items()})
    return GGUFFile(path), raws


def test_issue42_every_listed_type_is_accepted_and_iq1_still_is_not() -> None:
    assert set(NEW_TYPES) <= SUPPORTED_TENSOR_TYPES
    assert "IQ1_S" not in SUPPORTED_TENSOR_TYPES and "IQ1_M" not in SUPPORTED_TENSOR_TYPES


@pytest.mark.parametrize("type_name", NEW_TYPES)
def test_issue42_type_dequantizes_equal_to_the_gguf_package(
        typed_file: tuple[GGUFFile, dict[str, np.ndarray]], type_name: str) -> None:
    file, raws = typed_file
    name = f"{type_name.lower()}.weight"
    assert file.tensors[name].type_name == type_name and file.tensors[name].shape == (ROWS, COLS)
    reference = gguf.quants.dequantize(raws[type_name], Q[type_name])
    values = file.dequantize(name)
    assert values.dtype == np.float32 and np.isfinite(values).all()
    np.testing.assert_array_equal(values, reference)
    assert np.abs(values).max() > 0  # the scales are not all zero: the equalities are not vacuous


@pytest.mark.parametrize("type_name", NEW_TYPES)
def test_issue42_stored_codes_give_the_dequantized_values_bit_for_bit(
        typed_file: tuple[GGUFFile, dict[str, np.ndarray]], type_name: str) -> None:
    file, _ = typed_file
    name = f"{type_name.lower()}.weight"
    codes, scale, low, units = file.int8_levels(name)
    group, bound = GROUPS[type_name]
    assert codes.dtype == np.int8 and codes.shape == (ROWS, COLS) and scale.shape == (ROWS, COLS // group)
    assert (low is not None) == (type_name in ("Q5_1", "Q5_K", "Q2_K"))
    assert int(np.abs(codes.astype(np.int32)).max()) <= bound
    rebuilt = codes.reshape(ROWS, -1, group).astype(np.float32) * scale[..., None]
    rebuilt = (rebuilt if low is None else rebuilt + low[..., None]).reshape(ROWS, COLS)
    np.testing.assert_array_equal(rebuilt, file.dequantize(name))
    if units is not None:  # a superblock's scales are integer multiples of its units (the kernel's compact form)
        unit = np.repeat(units[..., 0], 256 // group, axis=1)
        multiples = np.rint(np.divide(scale, unit, out=np.zeros_like(scale), where=unit != 0))
        np.testing.assert_array_equal(unit * multiples, scale)


def test_issue42_a_misread_code_would_be_caught(typed_file: tuple[GGUFFile, dict[str, np.ndarray]]) -> None:
    """The bit-for-bit check sees a slip of one bit field: Q3_K with its high-bit mask ignored."""
    file, _ = typed_file
    codes, scale, _, _ = file.int8_levels("q3_k.weight")
    wrong = (codes & 3).reshape(ROWS, -1, 16).astype(np.float32) * scale[..., None]
    assert not np.array_equal(wrong.reshape(ROWS, COLS), file.dequantize("q3_k.weight"))


@pytest.mark.parametrize("type_name", ["MXFP4", "TQ1_0", "TQ2_0"])
def test_issue42_the_gguf_packages_own_quantizer_round_trips(tmp_path: Path, type_name: str) -> None:
    """Blocks from the package's quantizer (as a converter writes them), not random bytes."""
    weights = (np.random.default_rng(7).standard_normal((64, 512)) * 0.05).astype(np.float32)
    raw = gguf.quants.quantize(weights, Q[type_name])
    file = GGUFFile(write_gguf(tmp_path / "q.gguf", "llama", {"w.weight": (raw, Q[type_name])}))
    values = file.dequantize("w.weight")
    np.testing.assert_array_equal(values, gguf.quants.dequantize(raw, Q[type_name]))
    codes, scale, low, _ = file.int8_levels("w.weight")
    group = GROUPS[type_name][0]
    assert low is None
    np.testing.assert_array_equal((codes.reshape(64, -1, group) * scale[..., None]).reshape(64, -1), values)
    assert np.corrcoef(values.ravel(), weights.ravel())[0, 1] > 0.65  # near the weights (ternary: ~0.7)


needs_kernels = pytest.mark.skipif(not paged_attention.available(), reason="no C++ compiler for the CPU kernels")


@needs_kernels
@pytest.mark.parametrize("type_name", NEW_TYPES)
def test_issue42_fast_path_equals_the_widened_path_within_rounding(
        typed_file: tuple[GGUFFile, dict[str, np.ndarray]], type_name: str) -> None:
    """The int8 kernel on the stored codes (6-bit packed where they fit) against float64 x @ W.T of the
    dequantized weight: float32 rounding only (no second quantization of the weights or activations)."""
    file, _ = typed_file
    codes, scale, low, units = (None if a is None else torch.from_numpy(a)
                                for a in file.int8_levels(f"{type_name.lower()}.weight"))
    linear = QuantLinear(Int8Levels(codes, scale, low, units), None, search=False)
    assert linear.int8_kernel and linear.weight is None  # kept once, as stored: no bfloat16 copy
    packed_6bit = linear.qweight.dtype == torch.int32
    assert packed_6bit == (GROUPS[type_name][1] <= 31)
    x = torch.randn(5, COLS, generator=torch.Generator().manual_seed(1))
    widened = x.double() @ torch.from_numpy(file.dequantize(f"{type_name.lower()}.weight")).double().T
    got = linear(x)
    assert got.dtype == torch.float32
    assert float((got.double() - widened).abs().max()) <= 2e-6 * float(widened.abs().max())
    for row in range(5):  # a row's bits do not depend on its batch
        assert torch.equal(linear(x[row:row + 1])[0], got[row])


def test_issue42_an_unsupported_type_is_refused_in_one_line_naming_type_and_tensor(tmp_path: Path) -> None:
    _, block_bytes = gguf.GGML_QUANT_SIZES[Q.IQ1_M]
    path = write_gguf(tmp_path / "iq1m.gguf", "llama", {
        "token_embd.weight": (random_blocks("IQ4_XS", 0), Q.IQ4_XS),
        "blk.0.attn_q.weight": (np.zeros((4, block_bytes), np.uint8), Q.IQ1_M)})
    with pytest.raises(ModelLoadError) as caught:
        GGUFFile(path)
    message = str(caught.value)
    assert "\n" not in message and "blk.0.attn_q.weight" in message and "type IQ1_M" in message


def test_issue42_a_stack_of_mxfp4_experts_dequantizes_equal_to_the_gguf_package(tmp_path: Path) -> None:
    """gpt-oss GGUFs store their expert stacks [experts, rows, cols] in MXFP4: dequantized, the package's
    values; as codes (`int8_levels`, experts stacked as E * rows, issue 40's QuantExperts), the same values."""
    raw = random_gguf_blocks("MXFP4", 4 * 64, 256, 3).reshape(4, 64, -1)
    file = GGUFFile(write_gguf(tmp_path / "experts.gguf", "llama", {"blk.0.ffn_up_exps.weight": (raw, Q.MXFP4)}))
    assert file.tensors["blk.0.ffn_up_exps.weight"].shape == (4, 64, 256)
    values = file.dequantize("blk.0.ffn_up_exps.weight")
    np.testing.assert_array_equal(values, gguf.quants.dequantize(raw, Q.MXFP4))
    codes, scale, low, _ = file.int8_levels("blk.0.ffn_up_exps.weight")
    assert codes.shape == (4 * 64, 256) and low is None
    rebuilt = codes.astype(np.float32).reshape(4 * 64, scale.shape[1], -1) * scale[:, :, None]
    np.testing.assert_array_equal(rebuilt.reshape(4, 64, 256), values)
