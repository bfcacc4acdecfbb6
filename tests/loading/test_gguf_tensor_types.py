"""GGUF tensor types (A2): F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K tensors
written to a real GGUF file come back through `GGUFFile.dequantize` as float32 in PyTorch shape,
within the format's own error of the original weights. The slow test checks the decoder on the
real Gemma 3 and SmolLM2 files against llama.cpp-style reference loops."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from mlxcel.loading.gguf import SUPPORTED_TENSOR_TYPES, GGUFFile

from . import kquants
from .tiny_checkpoint import write_gguf

Q = gguf.GGMLQuantizationType
ROWS, COLS = 6, 512  # two K-quant super-blocks per row

# Type -> (values sharing one scale, bits per value): the error bound is one step of a grid of
# 2**bits levels spanning each group's range, which every encoding here stays within.
BLOCK_GRIDS = {
    "Q8_0": (32, 8), "Q4_0": (32, 4), "Q4_1": (32, 4), "Q5_0": (32, 5), "Q5_1": (32, 5),
    "Q4_K": (32, 4), "Q5_K": (32, 5), "Q6_K": (16, 6),
}  # fmt: skip
# (rtol, atol): half an ulp of the stored mantissa; F16's atol is half its subnormal spacing.
FLOAT_TOL = {"F32": (0.0, 0.0), "F16": (2.0**-11, 2.0**-25), "BF16": (2.0**-8, 0.0)}
K_ENCODERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_K": kquants.quantize_q4_k, "Q5_K": kquants.quantize_q5_k, "Q6_K": kquants.quantize_q6_k,
}


def original_weights(seed: int) -> np.ndarray:
    """Weight-like values: small, zero-centred, with rows of different scale and a few outliers."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((ROWS, COLS)) * np.geomspace(0.01, 0.5, ROWS)[:, None]
    values[rng.integers(0, ROWS, 4), rng.integers(0, COLS, 4)] *= 8
    return values.astype(np.float32)


def encode(values: np.ndarray, type_name: str) -> tuple[np.ndarray, Q | None]:
    """The array to hand GGUFWriter (raw blocks for quantized types) and its raw type."""
    if type_name == "F32":
        return values, None
    if type_name == "F16":
        return values.astype(np.float16), None
    if type_name in K_ENCODERS:  # the gguf package decodes K-quants but cannot encode them
        return K_ENCODERS[type_name](values), Q[type_name]
    return gguf.quants.quantize(values, Q[type_name]), Q[type_name]


TYPES = ["F32", "F16", "BF16", *BLOCK_GRIDS]


@pytest.fixture(scope="module")
def typed_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[GGUFFile, dict[str, np.ndarray]]:
    originals = {t: original_weights(seed) for seed, t in enumerate(TYPES)}
    tensors = {f"{t.lower()}.weight": encode(values, t) for t, values in originals.items()}
    path = write_gguf(tmp_path_factory.mktemp("types") / "types.gguf", "llama", tensors)
    return GGUFFile(path), originals


def test_a2_every_required_type_is_supported() -> None:
    required = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K"}
    assert required <= SUPPORTED_TENSOR_TYPES


@pytest.mark.parametrize("type_name", TYPES)
def test_a2_tensor_type_dequantizes_within_its_format_error(
        typed_file: tuple[GGUFFile, dict[str, np.ndarray]], type_name: str) -> None:
    file, originals = typed_file
    name, original = f"{type_name.lower()}.weight", originals[type_name]
    assert file.tensors[name].type_name == type_name
    assert file.tensors[name].shape == (ROWS, COLS)  # PyTorch order: rows first
    values = file.dequantize(name)
    assert values.dtype == np.float32 and values.shape == (ROWS, COLS)
    if type_name in FLOAT_TOL:
        rtol, atol = FLOAT_TOL[type_name]
        np.testing.assert_allclose(values, original, rtol=rtol, atol=atol)
    else:
        assert_within_block_grid(values, original, *BLOCK_GRIDS[type_name])


@pytest.mark.parametrize("type_name", TYPES)
def test_a2_4bit_types_give_their_stored_levels_and_others_none(
        typed_file: tuple[GGUFFile, dict[str, np.ndarray]], type_name: str) -> None:
    """Issue 11 point 7: a Q4_0 / Q4_1 / Q4_K weight is packed from its blocks as stored (levels,
    steps, lows), which must be exactly the values `dequantize` gives; every other type has none."""
    file, _ = typed_file
    name = f"{type_name.lower()}.weight"
    levels = file.int4_levels(name)
    if type_name not in ("Q4_0", "Q4_1", "Q4_K"):
        assert levels is None
        return
    q, step, low, units = levels
    assert q.dtype == np.uint8 and q.shape == (ROWS, COLS) and int(q.max()) <= 15
    assert step.shape == low.shape == (ROWS, COLS // 32) and step.dtype == np.float32
    rebuilt = (low[..., None] + q.reshape(ROWS, COLS // 32, 32) * step[..., None]).reshape(ROWS, COLS)
    np.testing.assert_array_equal(rebuilt, file.dequantize(name))
    if type_name != "Q4_K":
        assert units is None
        return
    # Issue 27: Q4_K's steps and lows are d and -dmin of their superblock times 6-bit integers, exactly.
    assert units.shape == (ROWS, COLS // 256, 2)
    for part, values in enumerate((step, low)):
        unit = np.repeat(units[..., part], 8, axis=1)
        multiples = np.rint(np.divide(values, unit, out=np.zeros_like(values), where=unit != 0))
        assert multiples.min() >= 0 and multiples.max() <= 63
        np.testing.assert_array_equal(unit * multiples, values)


@pytest.mark.parametrize("type_name", TYPES)
def test_issue27_int8_code_types_give_their_stored_codes_and_others_none(
        typed_file: tuple[GGUFFile, dict[str, np.ndarray]], type_name: str) -> None:
    """Issue 27 point 3: a Q8_0 / Q5_0 / Q6_K weight is kept as its stored int8 codes and group scales
    (32 a scale; Q6_K 16), which must give exactly the values `dequantize` gives (issue 42: Q5_K too, its
    5-bit levels with a low per group, and Q5_1 likewise); other types have none."""
    file, _ = typed_file
    name = f"{type_name.lower()}.weight"
    stored = file.int8_levels(name)
    groups = {"Q8_0": 32, "Q5_0": 32, "Q6_K": 16, "Q5_K": 32, "Q5_1": 32}
    if type_name not in groups:
        assert stored is None
        return
    codes, scale, low, units = stored
    group = groups[type_name]
    assert codes.dtype == np.int8 and codes.shape == (ROWS, COLS)
    assert scale.dtype == np.float32 and scale.shape == (ROWS, COLS // group)
    assert (low is not None) == (type_name in ("Q5_K", "Q5_1"))
    bound = {"Q8_0": 127, "Q5_0": 16, "Q6_K": 32, "Q5_K": 31, "Q5_1": 31}[type_name]
    assert int(np.abs(codes.astype(np.int32)).max()) <= bound
    rebuilt = codes.reshape(ROWS, -1, group) * scale[..., None]
    rebuilt = (rebuilt if low is None else rebuilt + low[..., None]).reshape(ROWS, COLS)
    np.testing.assert_allclose(rebuilt, file.dequantize(name), rtol=2e-7, atol=0)  # float32 product order only
    if type_name not in ("Q6_K", "Q5_K"):
        assert units is None
        return
    # Issue 27: Q6_K's scales are its superblock's d times int8 integers, exactly (Q5_K: d and -dmin).
    assert units.shape == (ROWS, COLS // 256, 1 if low is None else 2)
    unit = np.repeat(units[..., 0], 256 // group, axis=1)
    multiples = np.rint(np.divide(scale, unit, out=np.zeros_like(scale), where=unit != 0))
    assert np.abs(multiples).max() <= 127
    np.testing.assert_array_equal(unit * multiples, scale)


def test_a2_large_tensors_dequantize_in_slices_with_the_same_values(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import mlxcel.loading.gguf as gguf_module

    values = np.random.default_rng(3).standard_normal((64, 256)).astype(np.float32)
    path = write_gguf(tmp_path / "q.gguf", "llama", {"w.weight": encode(values, "Q8_0")})
    whole = GGUFFile(path).dequantize("w.weight")
    monkeypatch.setattr(gguf_module, "DEQUANTIZE_CHUNK", 1000)  # 3 rows of 272 bytes a slice
    np.testing.assert_array_equal(GGUFFile(path).dequantize("w.weight"), whole)


def assert_within_block_grid(values: np.ndarray, original: np.ndarray, group: int, bits: int) -> None:
    error = np.abs(values - original).reshape(-1, group)
    groups = original.reshape(-1, group)
    step = (groups.max(axis=1) - groups.min(axis=1)) / (2**bits - 1)
    worst = int(np.argmax(error.max(axis=1) / step))
    assert (error.max(axis=1) <= step).all(), (
        f"group {worst}: error {error[worst].max():.3g} > one grid step {step[worst]:.3g}")
    # Far below one step on average: a misplaced nibble or scale would be of the order of the range.
    assert error.mean() < 0.3 * step.mean()


def test_a2_a_misread_block_layout_would_be_caught(typed_file: tuple[GGUFFile, dict[str, np.ndarray]]) -> None:
    """The bound is tight enough to see a layout slip: Q4_K decoded as if its rows were swapped."""
    file, originals = typed_file
    shuffled = file.dequantize("q4_k.weight")[::-1]
    with pytest.raises(AssertionError):
        assert_within_block_grid(shuffled, originals["Q4_K"], *BLOCK_GRIDS["Q4_K"])


# ---- real checkpoints: the decoder against llama.cpp's row loops ----------------------------------

REFERENCE_DECODERS: dict[str, tuple[Callable[[np.ndarray], np.ndarray], int]] = {
    # type -> (decoder of one block, bytes per block)
    "Q4_K": (kquants.reference_dequantize_q4_k, 144),
    "Q6_K": (kquants.reference_dequantize_q6_k, 210),
    "Q5_0": (kquants.reference_dequantize_q5_0, 22),
    "Q8_0": (kquants.reference_dequantize_q8_0, 34),
    "Q4_1": (kquants.reference_dequantize_q4_1, 20),
}


@pytest.fixture(scope="module")
def real_files() -> dict[str, GGUFFile]:
    """Each real file opened once: reading Gemma 3's 262k-token vocabulary takes a while."""
    return {}


def reference_row(raw_row: np.ndarray, type_name: str) -> np.ndarray:
    decode, block_bytes = REFERENCE_DECODERS[type_name]
    return np.concatenate([decode(raw_row[i:i + block_bytes]) for i in range(0, raw_row.size, block_bytes)])


@pytest.mark.slow
@pytest.mark.parametrize(("checkpoint", "type_name"), [
    ("gemma3_path", "Q4_K"), ("gemma3_path", "Q6_K"), ("gemma3_path", "Q5_0"), ("gemma3_path", "Q8_0"),
    ("smollm2_path", "Q4_1"),
])
def test_a2_real_blocks_decode_as_llama_cpp_reads_them(request: pytest.FixtureRequest, real_files: dict[str, GGUFFile],
                                                       checkpoint: str, type_name: str) -> None:
    """Blocks written by llama.cpp's own quantizer (Gemma 3 270M Q4_K_M, SmolLM2 Q4_1) decode like its C loops."""
    if checkpoint not in real_files:
        real_files[checkpoint] = GGUFFile(request.getfixturevalue(checkpoint))
    file = real_files[checkpoint]
    candidates = [t for t in file.tensors.values() if t.type_name == type_name and len(t.shape) == 2]
    name = min(candidates, key=lambda t: t.raw.size).name  # the smallest: decoding token_embd takes seconds
    values = file.dequantize(name)
    assert values.shape == file.tensors[name].shape
    raw = np.asarray(file.tensors[name].raw).reshape(values.shape[0], -1)
    for row in (0, values.shape[0] // 2, values.shape[0] - 1):
        np.testing.assert_allclose(values[row], reference_row(raw[row], type_name), rtol=1e-6, atol=1e-7,
                                   err_msg=f"{name} row {row}")
