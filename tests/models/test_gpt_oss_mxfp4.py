"""gpt-oss as people download it (issues 40, 42): the released checkpoints keep the experts in MXFP4
(`*_blocks`: two E2M1 codes a byte, `*_scales`: E8M0, `quantization_config.quant_method: mxfp4`), and
every gpt-oss GGUF stores them as GGUF MXFP4 (llama.cpp's converter repacks the same bits).

The reference is transformers itself: the same folder loaded with `Mxfp4Config(dequantize=True)` (its
`convert_moe_packed_tensors`, on the CPU), float32 forward. Our logits equal it within float32 rounding
(<= 2e-5; measured ~4e-7): the codes are exact (E2M1 doubled is an integer, the scale a power of two).
On the CPU decode rewrite the experts stay those codes (6-bit packed codes and float16 scales: 0.81
bytes a weight against the file's 0.53); the other linears, bfloat16 in the file, go per-channel int8, so
that model's logits are compared loosely (the experts' own output exactly).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from mlxcel.layers import paged_attention
from mlxcel.layers.moe import QuantExperts
from mlxcel.layers.quant import quantize
from mlxcel.loading import load_model
from mlxcel.loading.gguf import GGUFFile
from mlxcel.loading.lazy import materialize_all
from mlxcel.loading.quantized import QuantizedFolder, quant_format

from .gguf_layouts import LAYOUTS, _add, converter_metadata, converter_tensors
from .harness import batch_uncached_logits, greedy, lockstep_cached_logits, save_tiny_hf, uncached_logits
from .test_families import MOE_COMMON, PROMPTS, TOL_SAME_MATH, TOL_VS_TRANSFORMERS, VOCAB

NUM_EXPERTS = 4
MXFP4 = {"quant_method": "mxfp4",  # as openai/gpt-oss-20b's config.json has it
         "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                    "lm_head"]}


def gpt_oss_config(vocab_size: int = VOCAB) -> transformers.GptOssConfig:
    return transformers.GptOssConfig(**{**MOE_COMMON, "vocab_size": vocab_size}, head_dim=16,
                                     num_local_experts=NUM_EXPERTS, sliding_window=4)


def to_mxfp4_checkpoint(folder: Path, seed: int = 0) -> None:
    """A saved gpt-oss folder's expert stacks replaced by random MXFP4 blocks and scales in the released
    layout ([E, rows, K / 32, 16] and [E, rows, K / 32], rows the outputs: gate_up's interleaved)."""
    state = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        num, k, rows = state.pop(name).shape  # x @ W: [E, K, rows]
        state[f"{name}_blocks"] = torch.randint(0, 256, (num, rows, k // 32, 16), dtype=torch.uint8, generator=generator)
        # 2^-8 .. 2^-6 times E2M1's 0 .. 6: small enough that greedy text is not one token repeated
        state[f"{name}_scales"] = torch.randint(119, 122, (num, rows, k // 32), dtype=torch.uint8, generator=generator)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4}))


def transformers_reference(folder: Path) -> torch.nn.Module:
    config = transformers.Mxfp4Config(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=config,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    save_tiny_hf(gpt_oss_config(), folder)
    to_mxfp4_checkpoint(folder)
    return folder, transformers_reference(folder)


@pytest.fixture(scope="module")
def reference_tokens(checkpoint: tuple[Path, torch.nn.Module]) -> list[int]:
    """transformers' 16 greedy tokens after PROMPTS[1] (its own generate, KV cache and all)."""
    reference, prompt = checkpoint[1], PROMPTS[1]
    with torch.inference_mode():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    tokens = out[0, len(prompt):].tolist()
    assert len(set(tokens)) > 1  # a test of something: not one token repeated
    return tokens


@torch.inference_mode()
def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]


# ---- the safetensors folder ----------------------------------------------------------------------

def test_issue42_mxfp4_folder_is_detected_and_loads_to_transformers_logits(checkpoint: tuple[Path, Any],
                                                                          reference_tokens: list[int]) -> None:
    folder, reference = checkpoint
    loaded = load_model(folder)
    assert loaded.model_type == "gpt_oss"
    assert loaded.weights_info()["format"] == "mxfp4" and "MXFP4" in loaded.weights_info()["description"]
    for prompt in PROMPTS:
        torch.testing.assert_close(uncached_logits(loaded.model, prompt), reference_logits(reference, prompt),
                                   atol=TOL_VS_TRANSFORMERS, rtol=0)
    assert greedy(loaded.model, PROMPTS[1], 16) == reference_tokens
    alone = [uncached_logits(loaded.model, p) for p in PROMPTS]
    for got, want in zip(batch_uncached_logits(loaded.model, PROMPTS), alone):
        torch.testing.assert_close(got, want, atol=TOL_SAME_MATH, rtol=0)
    for got, want in zip(lockstep_cached_logits(loaded.model, PROMPTS, prefill_len=3), alone):
        torch.testing.assert_close(got, want, atol=TOL_SAME_MATH, rtol=0)


def test_issue42_mxfp4_codes_are_transformers_dequantized_experts_exactly(checkpoint: tuple[Path, Any]) -> None:
    """llama.cpp's split (gate: even rows of gate_up, up: odd, down) of the stored codes equals transformers'
    dequantized weights bit for bit; a linear outside the experts has none."""
    folder, reference = checkpoint
    stored = QuantizedFolder(folder, quant_format(json.loads((folder / "config.json").read_text())))
    experts = reference.model.layers[1].mlp.experts
    rows = experts.gate_up_proj.detach().transpose(1, 2)  # [E, 2I, H]
    expected = {"gate_proj": rows[:, 0::2], "up_proj": rows[:, 1::2], "down_proj": experts.down_proj.detach().transpose(1, 2)}
    for part, want in expected.items():
        levels = stored.int8_levels(f"model.layers.1.mlp.experts.{part}.weight")
        assert levels is not None and levels.group == 32 and int(levels.codes.abs().max()) <= 12
        assert torch.equal(levels.dequantize(), want.reshape(-1, want.shape[-1]))
    assert stored.int8_levels("model.layers.1.self_attn.q_proj.weight") is None
    assert stored.int4_levels("model.layers.1.mlp.experts.gate_proj.weight") is None


@pytest.mark.skipif(not paged_attention.available(), reason="the CPU kernels did not build")
def test_issue42_mxfp4_experts_stay_codes_on_the_cpu_decode_path(checkpoint: tuple[Path, Any]) -> None:
    from mlxcel.serving.served_model import weights_report

    folder, reference = checkpoint
    floats = load_model(folder).model
    loaded = load_model(folder, lazy=True)
    quantize(loaded.model)
    materialize_all(loaded.model)
    packed = [m for m in loaded.model.modules() if isinstance(m, QuantExperts)]
    assert len(packed) == 2
    assert all(lin.int8_kernel and lin.weight is None for m in packed for lin in [*m.gate_up, *m.down])
    # The experts alone: the file's codes times float32 rows, as the float experts on transformers' values.
    torch.manual_seed(0)
    x, ids = torch.randn(6, 64), torch.stack([torch.randperm(NUM_EXPERTS)[:2] for _ in range(6)])
    weights = torch.rand(6, 2)
    with torch.inference_mode():
        want = floats.model.layers[0].mlp.experts(x, ids, weights, path="per_expert")
        got_experts = packed[0](x, ids, weights)
    torch.testing.assert_close(got_experts, want, atol=1e-5 * float(want.abs().max()), rtol=0)
    got, ref = uncached_logits(loaded.model, PROMPTS[2]), reference_logits(reference, PROMPTS[2])
    assert float((got - ref).abs().max()) < 0.03 * float(ref.abs().max())  # attention / head: per-channel int8
    # Resident: the experts as 6-bit codes and float16 scales, against the file's 4.25 bits a weight.
    expert_bytes = sum(t.numel() * t.element_size() for m in packed for lin in [*m.gate_up, *m.down]
                       for t in (lin.qweight, lin.scale))
    file_expert_bytes = sum(t.numel() for n, t in load_file(folder / "model.safetensors").items()
                            if n.endswith(("_blocks", "_scales")))
    assert expert_bytes <= 1.6 * file_expert_bytes
    report = weights_report(loaded)
    assert report["format"] == "mxfp4" and report["resident_bytes"] < report["file_bytes"]


# ---- GGUF ------------------------------------------------------------------------------------------

def ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' MXFP4 blocks as ggml's MXFP4 (GptOssModel.repack_mxfp4): per 32 weights the E8M0 byte,
    then 16 bytes holding weight j in the low nibble and j + 16 in the high one (HF: 2j low, 2j + 1 high)."""
    codes = np.stack((blocks & 15, blocks >> 4), axis=-1).reshape(*blocks.shape[:-1], 32)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate((scales[..., None], packed), axis=-1).reshape(*blocks.shape[:-2], -1)


def mxfp4_gguf_tensors(folder: Path, reference: torch.nn.Module) -> dict[str, tuple[np.ndarray, Any]]:
    """GGUF name -> (array, raw type or None) as the converter writes the MXFP4 folder: the experts' bits
    repacked (gate the even rows of gate_up, up the odd ones), everything else as gguf_layouts' F32."""
    tensors: dict[str, tuple[np.ndarray, Any]] = {
        name: (array, None) for name, array in converter_tensors(reference, LAYOUTS["gpt_oss"]).items()}
    state = load_file(folder / "model.safetensors")
    for layer in range(reference.config.num_hidden_layers):
        stem = f"model.layers.{layer}.mlp.experts"
        gate_up = (state[f"{stem}.gate_up_proj_blocks"].numpy(), state[f"{stem}.gate_up_proj_scales"].numpy())
        parts = {"gate": (gate_up[0][:, 0::2], gate_up[1][:, 0::2]), "up": (gate_up[0][:, 1::2], gate_up[1][:, 1::2]),
                 "down": (state[f"{stem}.down_proj_blocks"].numpy(), state[f"{stem}.down_proj_scales"].numpy())}
        for part, (blocks, scales) in parts.items():
            tensors[f"blk.{layer}.ffn_{part}_exps.weight"] = (ggml_mxfp4(blocks, scales), gguf.GGMLQuantizationType.MXFP4)
    return tensors


def write_mxfp4_gguf(folder: Path, reference: torch.nn.Module, path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    for key, value in converter_metadata(reference.config, LAYOUTS["gpt_oss"]).items():
        _add(writer, f"gpt-oss.{key}", value)
    for name, (array, raw_dtype) in mxfp4_gguf_tensors(folder, reference).items():
        writer.add_tensor(name, np.ascontiguousarray(array), raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_issue40_gpt_oss_mxfp4_gguf_loads_to_the_same_logits_and_codes(checkpoint: tuple[Path, Any],
                                                                       reference_tokens: list[int], tmp_path: Path) -> None:
    folder, reference = checkpoint
    path = write_mxfp4_gguf(folder, reference, tmp_path / "gpt-oss.gguf")
    assert GGUFFile(path).tensors["blk.0.ffn_up_exps.weight"].type_name == "MXFP4"
    loaded = load_model(path)
    assert loaded.model_type == "gpt_oss"
    for prompt in PROMPTS:
        torch.testing.assert_close(uncached_logits(loaded.model, prompt), reference_logits(reference, prompt),
                                   atol=TOL_VS_TRANSFORMERS, rtol=0)
    assert greedy(loaded.model, PROMPTS[1], 16) == reference_tokens
    # The same bits reach the CPU kernels from either file.
    from mlxcel.loading.checkpoint import GGUFPackedWeights
    from mlxcel.models import gpt_oss

    from_gguf = GGUFPackedWeights(loaded.gguf, gpt_oss, loaded.config)
    from_folder = QuantizedFolder(folder, quant_format(json.loads((folder / "config.json").read_text())))
    for part in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.0.mlp.experts.{part}.weight"
        ours, theirs = from_gguf.int8_levels(name), from_folder.int8_levels(name)
        assert torch.equal(ours.codes, theirs.codes) and torch.equal(ours.scale, theirs.scale)


LLAMA_CPP = os.environ.get("MLXCEL_LLAMA_CPP")


@pytest.mark.slow
@pytest.mark.skipif(not LLAMA_CPP, reason="MLXCEL_LLAMA_CPP (a llama.cpp source folder) is not set")
def test_issue40_llama_cpp_converts_the_mxfp4_folder_to_our_layout(tmp_path: Path) -> None:
    """convert_hf_to_gguf.py on the MXFP4 folder (SmolLM2's tokenizer): its tensors equal what
    `mxfp4_gguf_tensors` writes (the MXFP4 bytes too) and it loads to transformers' logits."""
    from .test_gguf_families import convert_with_llama_cpp, save_with_smollm2_tokenizer

    folder = tmp_path / "hf"
    save_with_smollm2_tokenizer(gpt_oss_config(), folder)
    to_mxfp4_checkpoint(folder)
    reference = transformers_reference(folder)
    converted = GGUFFile(convert_with_llama_cpp(Path(LLAMA_CPP), folder, tmp_path / "gpt-oss.gguf"))
    ours = mxfp4_gguf_tensors(folder, reference)
    assert sorted(converted.tensors) == sorted(ours)
    for name, (array, raw_dtype) in ours.items():
        tensor = converted.tensors[name]
        if raw_dtype is None:
            np.testing.assert_array_equal(converted.dequantize(name).reshape(array.shape), array, err_msg=name)
        else:
            assert tensor.type_name == "MXFP4"
            np.testing.assert_array_equal(np.asarray(tensor.raw).reshape(-1), array.reshape(-1), err_msg=name)
    loaded = load_model(converted.path)
    prompt = [5, 17, 99, 3, 42, 7, 8, 120, 4000, 31000]
    torch.testing.assert_close(uncached_logits(loaded.model, prompt), reference_logits(reference, prompt),
                               atol=TOL_VS_TRANSFORMERS, rtol=0)
