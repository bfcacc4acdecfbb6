"""Every dense family from a GGUF as llama.cpp's own convert_hf_to_gguf.py writes it (issue 40):
its logits equal transformers' on the same weights (float32, F32 GGUF, <= 2e-5).

Two sources of the GGUF:
- CI: tests/models/gguf_layouts.py writes the converter's layout with the `gguf` package;
- MLXCEL_LLAMA_CPP=<llama.cpp source folder>: the converter itself runs on the tiny checkpoint
  (with SmolLM2's tokenizer, which it needs), and its file must equal what gguf_layouts.py writes
  (architecture, `<arch>.` metadata, tensor names, shapes and values) and load to the same logits.
  Skipped where that variable is unset.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
import transformers

from mlxcel.loading import load_model

from .gguf_layouts import LAYOUTS, converter_metadata, converter_tensors, write_converter_gguf
from .harness import save_tiny_hf, uncached_logits
from .test_families import COMMON, FAMILIES, LLAMA3_ROPE, MOE_COMMON, PROMPTS, TOL_VS_TRANSFORMERS, reference_logits

DEEPSEEK_MOE = dict(**{**COMMON, "num_key_value_heads": 4}, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                    v_head_dim=12, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                    topk_group=1, routed_scaling_factor=2.5, moe_intermediate_size=32, pad_token_id=0)
# HF model_type -> (model_type the GGUF loads as, a config the converter's file can express in full).
# Left out where the converter loses a setting llama.cpp then fixes in code: Qwen 2's, Mistral's and
# StarCoder 2's sliding window (not written), SmolLM3's no-rope interval (4 in llama.cpp),
# Gemma 3's sliding pattern and query scale (6 and head_dim in llama.cpp).
GGUF_CASES: dict[str, tuple[str, Callable[[], Any]]] = {
    "llama": ("llama", lambda: transformers.LlamaConfig(**COMMON, rope_scaling=LLAMA3_ROPE)),
    "mistral": ("llama", lambda: transformers.MistralConfig(**COMMON, sliding_window=None)),
    "qwen2": ("qwen2", FAMILIES["qwen2"][1]),
    "qwen3": ("qwen3", FAMILIES["qwen3"][1]),
    "gemma3_text": ("gemma3", FAMILIES["gemma3"][1]),
    "gemma4_text": ("gemma4_text", FAMILIES["gemma4"][1]),
    "gemma2": ("gemma2", FAMILIES["gemma2"][1]),
    "smollm3": ("smollm3", lambda: transformers.SmolLM3Config(
        **{**COMMON, "num_hidden_layers": 4}, pad_token_id=0)),
    "granite": ("granite", FAMILIES["granite"][1]),
    "olmo2": ("olmo2", FAMILIES["olmo2"][1]),
    "seed_oss": ("seed_oss", FAMILIES["seed_oss"][1]),
    # The converter insists on Hunyuan's real context (32k) for its NTK-alpha base.
    "hunyuan_v1_dense": ("hunyuan_v1_dense", lambda: transformers.HunYuanDenseV1Config(
        **{**COMMON, "max_position_embeddings": 32768}, head_dim=16,
        rope_scaling={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0})),
    "glm4": ("glm4", FAMILIES["glm4"][1]),
    "exaone4": ("exaone4", FAMILIES["exaone4"][1]),
    "starcoder2": ("starcoder2", lambda: transformers.Starcoder2Config(**COMMON, sliding_window=None)),
    "ernie4_5": ("ernie4_5", FAMILIES["ernie4_5"][1]),
    "phi3": ("phi3", FAMILIES["phi3"][1]),
    "cohere2": ("cohere2", FAMILIES["cohere2"][1]),
    # Issue 40: MoE families (the converter writes no sliding window for Mixtral).
    "mixtral": ("mixtral", lambda: transformers.MixtralConfig(**MOE_COMMON, num_local_experts=8, sliding_window=None)),
    "olmoe": ("olmoe", FAMILIES["olmoe"][1]),
    # Every layer MoE (llama.cpp's qwen2moe has no dense layers), with the gated shared expert.
    "qwen2_moe": ("qwen2_moe", lambda: transformers.Qwen2MoeConfig(
        **COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)),
    "granitemoe": ("granitemoe", FAMILIES["granitemoe"][1]),
    # gpt-oss with float experts (the MXFP4 files: test_gpt_oss_mxfp4.py); llama.cpp fixes the SwiGLU limit at 7.
    "gpt_oss": ("gpt_oss", lambda: transformers.GptOssConfig(**MOE_COMMON, head_dim=16, num_local_experts=4,
                                                            sliding_window=4)),
    # GLM-4.5's own grouping (one group: llama.cpp's glm4moe has the groups of every architecture, no more).
    "glm4_moe": ("glm4_moe", lambda: transformers.Glm4MoeConfig(
        **COMMON, head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        moe_intermediate_size=32, use_qk_norm=True, attention_bias=True, routed_scaling_factor=2.5)),
    # llama.cpp's deepseek2: V3 (sigmoid, selection bias, q_lora) and V2 (softmax, groups by their best
    # expert, no q_lora), MLA's kv_b split into k_b / v_b.
    "deepseek_v3": ("deepseek_v3", lambda: transformers.DeepseekV3Config(**DEEPSEEK_MOE, q_lora_rank=32)),
    "deepseek_v2": ("deepseek_v2", lambda: transformers.DeepseekV2Config(
        **DEEPSEEK_MOE, q_lora_rank=None, topk_method="group_limited_greedy", n_shared_experts=2)),
    # An older converter's file: kv_b whole (attn_kv_b), no key_length_mla / value_length_mla.
    "deepseek_v3-kv_b-whole": ("deepseek_v3", lambda: transformers.DeepseekV3Config(**DEEPSEEK_MOE, q_lora_rank=32)),
}
# Families whose converter class reads a SentencePiece tokenizer.model, which SmolLM2's tokenizer is not (Gemma 4:
# a byte-fallback BPE tokenizer.json, LlamaHfVocab; its metadata and tensors were written before the vocabulary).
NEEDS_SENTENCEPIECE = {"gemma2", "ernie4_5", "gemma4_text"}
OLDER_CONVERTER = {"deepseek_v3-kv_b-whole"}  # a layout today's converter no longer writes
# Special tokens a family's converter looks up in the tokenizer (GLM's `_set_vocab_glm`).
CONVERTER_SPECIAL_TOKENS = {"glm4_moe": ("[gMASK]", "<|user|>", "<|endoftext|>", "<|observation|>")}


def _assert_logits_match(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    for prompt in PROMPTS:
        torch.testing.assert_close(uncached_logits(model, prompt), reference_logits(reference, prompt),
                                   atol=TOL_VS_TRANSFORMERS, rtol=0)


@pytest.mark.parametrize("family", list(GGUF_CASES))
def test_issue40_gguf_in_the_converters_layout_loads_to_the_reference_logits(family: str, tmp_path: Path) -> None:
    loads_as, make_config = GGUF_CASES[family]
    reference = save_tiny_hf(make_config(), tmp_path / "hf")
    loaded = load_model(write_converter_gguf(reference, family, tmp_path / f"{family}.gguf"))
    assert loaded.model_type == loads_as
    _assert_logits_match(loaded.model, reference)


def test_issue40_gguf_architecture_names_map_through_one_table(tmp_path: Path) -> None:
    """llama.cpp's "hunyuan-dense" is our hunyuan_v1_dense; an unknown architecture is one clear error."""
    from mlxcel.loading import ModelLoadError
    from mlxcel.loading.checkpoint import GGUF_ARCHITECTURES

    assert GGUF_ARCHITECTURES["hunyuan-dense"] == "hunyuan_v1_dense"
    reference = save_tiny_hf(GGUF_CASES["llama"][1](), tmp_path / "hf")
    path = write_converter_gguf(reference, "llama", tmp_path / "x.gguf")
    data = path.read_bytes().replace(b"llama", b"lxama")  # the architecture and its key prefix
    (tmp_path / "odd.gguf").write_bytes(data)
    with pytest.raises(ModelLoadError, match="GGUF architecture 'lxama' is not supported"):
        load_model(tmp_path / "odd.gguf")


# ---- against the converter itself ----------------------------------------------------------------

LLAMA_CPP = os.environ.get("MLXCEL_LLAMA_CPP")
# transformers 5 swaps in Qwen2's / Phi-3's own tokenizer class for these model types whatever
# tokenizer_config.json says; the converter's pre-tokenizer check then fails on SmolLM2's vocabulary.
_RUN_CONVERTER = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
from transformers.models.auto import tokenization_auto
tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.difference_update({"qwen2", "phi3", "qwen3_5_moe_text"})
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert_with_llama_cpp(llama_cpp: Path, model_dir: Path, out: Path) -> Path:
    """Run llama.cpp's convert_hf_to_gguf.py (F32) on an HF folder."""
    result = subprocess.run([sys.executable, "-c", _RUN_CONVERTER, str(llama_cpp), str(model_dir),
                             "--outtype", "f32", "--outfile", str(out)], capture_output=True, text=True)
    if result.returncode:
        raise AssertionError(f"convert_hf_to_gguf.py failed:\n{result.stderr[-3000:]}")
    return out


def save_with_smollm2_tokenizer(config: Any, folder: Path, special_tokens: tuple[str, ...] = ()) -> torch.nn.Module:
    """The tiny checkpoint with SmolLM2's tokenizer (from its packaged GGUF) and its vocabulary size;
    `special_tokens` are added to it (a converter that looks its family's own up: GLM's `[gMASK]`, ...)."""
    from tests.conftest import smollm2_gguf
    from tokenizers import AddedToken

    from mlxcel.loading.gguf import GGUFFile
    from mlxcel.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(GGUFFile(smollm2_gguf()).metadata)
    tokenizer.backend.add_special_tokens([AddedToken(t, special=True) for t in special_tokens])
    config.vocab_size = tokenizer.backend.get_vocab_size()
    reference = save_tiny_hf(config, folder)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "TokenizersBackend", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    return reference


@pytest.mark.slow
@pytest.mark.skipif(not LLAMA_CPP, reason="MLXCEL_LLAMA_CPP (a llama.cpp source folder) is not set")
@pytest.mark.parametrize("family", [f for f in GGUF_CASES if f not in NEEDS_SENTENCEPIECE | OLDER_CONVERTER])
def test_issue40_llama_cpp_converter_output_equals_our_layout_and_loads(family: str, tmp_path: Path) -> None:
    from mlxcel.loading.gguf import GGUFFile

    loads_as, make_config = GGUF_CASES[family]
    reference = save_with_smollm2_tokenizer(make_config(), tmp_path / "hf", CONVERTER_SPECIAL_TOKENS.get(family, ()))
    path = convert_with_llama_cpp(Path(LLAMA_CPP), tmp_path / "hf", tmp_path / f"{family}.gguf")
    converted = GGUFFile(path)
    layout = LAYOUTS[family]
    assert converted.architecture == layout.arch
    prefix = f"{layout.arch}."
    theirs = {k[len(prefix):]: v for k, v in converted.metadata.items() if k.startswith(prefix)}
    ours = converter_metadata(reference.config, layout)
    assert sorted(theirs) == sorted(ours)
    for key, value in ours.items():
        assert theirs[key] == (value if isinstance(value, (str, list)) else pytest.approx(value, rel=1e-6)), key
    tensors = converter_tensors(reference, layout)
    assert sorted(converted.tensors) == sorted(tensors)
    for name, array in tensors.items():
        np.testing.assert_array_equal(converted.dequantize(name).reshape(array.shape), array, err_msg=name)
    loaded = load_model(path)
    assert loaded.model_type == loads_as
    _assert_logits_match(loaded.model, reference)
