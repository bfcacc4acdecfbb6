"""Every decoder family from a tiny random HF checkpoint (A2): logits equal transformers' on the
same weights, with and without the paged KV cache, alone and in a batch of mixed lengths.

Tolerances (float32, CPU): ours vs transformers <= 2e-5 absolute on logits of magnitude ~1-10
(measured up to 2.4e-6); cached vs uncached and batched vs alone <= 1e-5.

MLXCEL_TEST_DEVICE=cuda runs the per-family tests on the GPU, both models there (the lent device;
CI has none).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import transformers
from torch import nn

from mlxcel.loading import load_model

from .harness import (
    batch_uncached_logits, cached_logits, greedy, lockstep_cached_logits, save_tiny_hf, uncached_logits,
)

VOCAB = 128
TOL_VS_TRANSFORMERS = 2e-5
TOL_SAME_MATH = 1e-5
DEVICE = torch.device(os.environ.get("MLXCEL_TEST_DEVICE", "cpu"))
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256)
MOE_COMMON = {**COMMON, "intermediate_size": 32, "num_experts_per_tok": 2}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

# family id -> (expected model_type, transformers config)
FAMILIES: dict[str, tuple[str, Callable[[], Any]]] = {
    "llama": ("llama", lambda: transformers.LlamaConfig(**COMMON)),
    "llama-rope-llama3": ("llama", lambda: transformers.LlamaConfig(**COMMON, rope_scaling=LLAMA3_ROPE)),
    "qwen2": ("qwen2", lambda: transformers.Qwen2Config(**COMMON)),
    "qwen2-sliding": ("qwen2", lambda: transformers.Qwen2Config(
        **{**COMMON, "num_hidden_layers": 3}, use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen3": ("qwen3", lambda: transformers.Qwen3Config(**COMMON, head_dim=32)),
    # 6 layers: the default pattern (5 sliding, 1 global); a window of 4 is shorter than the prompts.
    "gemma3": ("gemma3_text", lambda: transformers.Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 6}, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # Every other layer global, a query scale apart from head_dim, and a local rope theta.
    "gemma3-pattern2": ("gemma3_text", lambda: transformers.Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 4}, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
        sliding_window_pattern=2, rope_local_base_freq=100.0)),
    # Gemma 4: sliding, global (another head size and KV-head count, values = keys' projection, proportional
    # rope), then two KV-shared layers (one of each type, double-wide MLPs); per-layer inputs; a window of 4.
    "gemma4": ("gemma4_text", lambda: transformers.Gemma4TextConfig(
        **{**COMMON, "num_hidden_layers": 4}, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, sliding_window=4, use_double_wide_mlp=True,
        final_logit_softcapping=30.0)),
    # Gemma 4's MoE variant (26B-A4B's shape): a dense MLP and 4 experts (top-2) side by side in every layer.
    "gemma4-moe": ("gemma4_text", lambda: transformers.Gemma4TextConfig(
        **COMMON, head_dim=16, global_head_dim=32, layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0, sliding_window=4, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=32)),
    # Issue 40: the dense families, each a recipe over layers/decoder.py.
    "qwen3-yarn": ("qwen3", lambda: transformers.Qwen3Config(**COMMON, head_dim=32, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("mistral", lambda: transformers.MistralConfig(**COMMON, sliding_window=4)),
    "ministral": ("ministral", lambda: transformers.MinistralConfig(
        **{**COMMON, "num_hidden_layers": 3}, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "smollm3": ("smollm3", lambda: transformers.SmolLM3Config(
        **{**COMMON, "num_hidden_layers": 4}, no_rope_layer_interval=2, pad_token_id=0)),
    "granite": ("granite", lambda: transformers.GraniteConfig(
        **COMMON, embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=4.0)),
    "olmo2": ("olmo2", lambda: transformers.Olmo2Config(**COMMON)),
    "seed_oss": ("seed_oss", lambda: transformers.SeedOssConfig(
        **COMMON, attention_bias=True, attention_out_bias=True, head_dim=16)),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", lambda: transformers.HunYuanDenseV1Config(
        **COMMON, head_dim=16, rope_scaling={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0})),
    "glm4": ("glm4", lambda: transformers.Glm4Config(**COMMON, head_dim=16, attention_bias=True, pad_token_id=0)),
    "exaone4": ("exaone4", lambda: transformers.Exaone4Config(
        **{**COMMON, "num_hidden_layers": 4}, sliding_window=4, sliding_window_pattern=2)),
    "starcoder2": ("starcoder2", lambda: transformers.Starcoder2Config(**COMMON, sliding_window=4)),
    "ernie4_5": ("ernie4_5", lambda: transformers.Ernie4_5Config(**COMMON, head_dim=16, use_bias=True)),
    # longrope: prompts stay inside the trained 32 positions, where transformers uses the short factors.
    "phi3": ("phi3", lambda: transformers.Phi3Config(
        **{**COMMON, "max_position_embeddings": 64}, original_max_position_embeddings=32, partial_rotary_factor=0.5,
        pad_token_id=0, rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(4)],
                                      "long_factor": [2.0 + i for i in range(4)]})),
    "gemma2": ("gemma2", lambda: transformers.Gemma2Config(
        **{**COMMON, "num_hidden_layers": 4}, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    # MLA: the latent cache (one head of kv_lora_rank + rope dims), absorbed projections; dense layers only.
    "deepseek_v3": ("deepseek_v3", lambda: transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, pad_token_id=0)),
    "deepseek_v3-yarn-no-q-lora": ("deepseek_v3", lambda: transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, pad_token_id=0, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
            "mscale_all_dim": 1.0})),
    "cohere2": ("cohere2", lambda: transformers.Cohere2Config(
        **{**COMMON, "num_hidden_layers": 4}, sliding_window=4, logit_scale=0.5)),
    # Issue 40: the mixture-of-experts families (8 experts, top-2, expert width 32) over layers/moe.py.
    "mixtral": ("mixtral", lambda: transformers.MixtralConfig(**MOE_COMMON, num_local_experts=8, sliding_window=4)),
    # Layer 0 dense (mlp_only_layers), layer 1 MoE with the gated shared expert.
    "qwen2_moe": ("qwen2_moe", lambda: transformers.Qwen2MoeConfig(
        **COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, mlp_only_layers=[0])),
    "qwen3_moe": ("qwen3_moe", lambda: transformers.Qwen3MoeConfig(
        **COMMON, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
    "olmoe": ("olmoe", lambda: transformers.OlmoeConfig(**MOE_COMMON, num_experts=8)),
    "granitemoe": ("granitemoe", lambda: transformers.GraniteMoeConfig(
        **MOE_COMMON, num_local_experts=8, embedding_multiplier=3.0, attention_multiplier=0.2,
        residual_multiplier=0.5, logits_scaling=4.0)),
    "phimoe": ("phimoe", lambda: transformers.PhimoeConfig(
        **MOE_COMMON, num_local_experts=8, attention_bias=True, lm_head_bias=True)),
    # Sliding and full layers alternate; a swiglu limit of 1 clamps many expert activations.
    "gpt_oss": ("gpt_oss", lambda: transformers.GptOssConfig(
        **MOE_COMMON, head_dim=16, num_local_experts=8, sliding_window=4, swiglu_limit=1.0)),
    # MLA with layer 1 MoE: 2 groups of 4 experts, the best group kept, a correction bias, a shared expert.
    "deepseek_v3-moe": ("deepseek_v3", lambda: transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, moe_intermediate_size=32, pad_token_id=0)),
    # Kimi K2: DeepSeek-V3's shape under its own model_type (the config is rewritten after saving).
    "kimi_k2": ("kimi_k2", lambda: transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, moe_intermediate_size=32, pad_token_id=0)),
    # DeepSeek-V2: MLA, layer 1 MoE with its softmax router limited to the best of 4 groups (each scored
    # by its best expert), times routed_scaling_factor, two shared experts.
    "deepseek_v2": ("deepseek_v2", lambda: transformers.DeepseekV2Config(
        **{**COMMON, "num_key_value_heads": 4}, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=2.5,
        moe_intermediate_size=32, n_shared_experts=2, pad_token_id=0)),
    "deepseek_v2-lite-greedy": ("deepseek_v2", lambda: transformers.DeepseekV2Config(
        **{**COMMON, "num_key_value_heads": 4}, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
        topk_method="greedy", moe_intermediate_size=32, n_shared_experts=1, pad_token_id=0)),
    # Layer 0 dense, layer 1 MoE: 2 groups of 4 experts, the best group kept, a correction bias.
    "glm4_moe": ("glm4_moe", lambda: transformers.Glm4MoeConfig(
        **COMMON, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, moe_intermediate_size=32, use_qk_norm=True, routed_scaling_factor=2.5)),
}

_rng = random.Random(1)
PROMPTS = [[_rng.randrange(VOCAB) for _ in range(n)] for n in (3, 8, 13, 21)]


@dataclass
class Tiny:
    family: str
    reference: nn.Module  # the transformers model the checkpoint was saved from
    ours: nn.Module  # our model, loaded from that checkpoint by mlxcel.loading.load_model
    model_type: str
    folder: Path


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    folder = tmp_path_factory.mktemp(request.param)
    model_type, config = FAMILIES[request.param]
    reference = save_tiny_hf(config(), folder, model_type=model_type).to(DEVICE)
    loaded = load_model(folder, device=DEVICE)
    return Tiny(request.param, reference, loaded.model, loaded.model_type, folder)


@torch.inference_mode()
def reference_logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids], device=DEVICE)).logits[0]


def test_a2_tiny_checkpoint_loads_as_its_family(tiny: Tiny) -> None:
    assert tiny.model_type == FAMILIES[tiny.family][0]
    assert sorted(p.name for p in tiny.folder.glob("*.safetensors")) == ["model.safetensors"]


def test_a2_logits_equal_transformers(tiny: Tiny) -> None:
    for prompt in PROMPTS:
        expected = reference_logits(tiny.reference, prompt)
        torch.testing.assert_close(uncached_logits(tiny.ours, prompt), expected,
                                   atol=TOL_VS_TRANSFORMERS, rtol=0)


@torch.inference_mode()
def test_issue40_greedy_tokens_equal_transformers(tiny: Tiny) -> None:
    """16 greedy tokens through the paged cache equal transformers' greedy tokens (full forward each step)."""
    prompt = PROMPTS[1]
    ids = list(prompt)
    for _ in range(16):
        ids.append(int(reference_logits(tiny.reference, ids)[-1].argmax()))
    assert greedy(tiny.ours, prompt, 16) == ids[len(prompt):]


def test_cached_logits_equal_uncached(tiny: Tiny) -> None:
    """Chunked prefill (6 + 5 tokens) then one token a step over a paged, shuffled block table."""
    prompt = PROMPTS[-1]
    torch.testing.assert_close(cached_logits(tiny.ours, prompt, (6, 5)), uncached_logits(tiny.ours, prompt),
                               atol=TOL_SAME_MATH, rtol=0)


def test_batch_of_mixed_lengths_gives_each_prompt_its_own_logits(tiny: Tiny) -> None:
    alone = [uncached_logits(tiny.ours, p) for p in PROMPTS]
    for got, want in zip(batch_uncached_logits(tiny.ours, PROMPTS), alone):
        torch.testing.assert_close(got, want, atol=TOL_SAME_MATH, rtol=0)
    # Cached: one mixed prefill step, then all four decode together (the grouped decode path).
    for got, want in zip(lockstep_cached_logits(tiny.ours, PROMPTS, prefill_len=3), alone):
        torch.testing.assert_close(got, want, atol=TOL_SAME_MATH, rtol=0)


def test_rope_scaling_changes_the_result() -> None:
    """llama3 rope scaling is read from the config and matters (else the llama3 case proves nothing)."""
    from mlxcel.models import llama

    plain = llama.ModelArgs.from_dict({**COMMON, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    scaled = llama.ModelArgs.from_dict({**COMMON, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 1e4}})
    assert plain.rope_scaling is None and scaled.rope_scaling["rope_type"] == "llama3"
    torch.manual_seed(0)
    model = llama.Model(scaled).eval()
    for p in model.parameters():
        nn.init.normal_(p, std=0.2)
    other = llama.Model(plain).eval()
    other.load_state_dict(model.state_dict())
    prompt = PROMPTS[-1]
    assert (uncached_logits(model, prompt) - uncached_logits(other, prompt)).abs().max() > 1e-3


def test_gemma3_sliding_window_limits_what_each_position_sees(tmp_path: Path) -> None:
    """Two sliding layers with a window of 4: position t sees tokens >= t - 6 and nothing older,
    uncached and through the cache; and transformers agrees on every position."""
    config = transformers.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=4,
                                           layer_types=["sliding_attention"] * 2)
    reference = save_tiny_hf(config, tmp_path).to(DEVICE)
    ours = load_model(tmp_path, device=DEVICE).model
    prompt = PROMPTS[-1]
    changed = [(prompt[0] + 1) % VOCAB, *prompt[1:]]
    base, moved = uncached_logits(ours, prompt), uncached_logits(ours, changed)
    reach = 2 * (4 - 1)
    assert (base[:reach + 1] - moved[:reach + 1]).abs().amax(dim=-1).min() > 1e-4
    torch.testing.assert_close(base[reach + 1:], moved[reach + 1:], atol=TOL_SAME_MATH, rtol=0)
    torch.testing.assert_close(base, reference_logits(reference, prompt), atol=TOL_VS_TRANSFORMERS, rtol=0)
    torch.testing.assert_close(cached_logits(ours, changed, (5,)), moved, atol=TOL_SAME_MATH, rtol=0)


def test_a2_unsupported_rope_type_is_one_clear_load_error(tmp_path: Path) -> None:
    from mlxcel.loading import ModelLoadError

    config = transformers.LlamaConfig(**COMMON)
    save_tiny_hf(config, tmp_path)
    text = (tmp_path / "config.json").read_text().replace('"rope_type": "default"', '"rope_type": "ntk_by_parts", "factor": 2.0')
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ModelLoadError, match=r"llama config cannot be used: rope scaling type 'ntk_by_parts' is not "
                                             r"supported \(supported: default, linear, dynamic, llama3, yarn, "
                                             r"longrope, proportional, freq_factors, mrope\)"):
        load_model(tmp_path)


def test_gemma3_sanitize_keeps_only_the_text_model_of_a_multimodal_checkpoint() -> None:
    from mlxcel.models import gemma3

    args = gemma3.ModelArgs.from_dict({**COMMON, "head_dim": 16})
    names = ["model.language_model.layers.0.mlp.up_proj.weight", "language_model.model.norm.weight",
             "model.language_model.embed_tokens.weight", "model.vision_tower.encoder.weight",
             "multi_modal_projector.mm_input_projection_weight", "lm_head.weight"]
    kept = gemma3.Model.sanitize({name: torch.zeros(1) for name in names}, args)
    assert sorted(kept) == ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]


def test_issue40_gemma2_soft_capping_takes_effect(tmp_path: Path) -> None:
    """Gemma 2's attention soft-cap is applied (a model without it gives other logits), uncached and cached."""
    config = FAMILIES["gemma2"][1]()
    reference = save_tiny_hf(config, tmp_path / "capped").to(DEVICE)
    ours = load_model(tmp_path / "capped", device=DEVICE).model
    config.attn_logit_softcapping = None
    save_tiny_hf(config, tmp_path / "uncapped")
    uncapped = load_model(tmp_path / "uncapped", device=DEVICE).model
    prompt = PROMPTS[-1]
    capped_logits = uncached_logits(ours, prompt)
    assert (capped_logits - uncached_logits(uncapped, prompt)).abs().max() > 1e-3
    torch.testing.assert_close(capped_logits, reference_logits(reference, prompt), atol=TOL_VS_TRANSFORMERS, rtol=0)
    torch.testing.assert_close(cached_logits(ours, prompt, (6, 5)), capped_logits, atol=TOL_SAME_MATH, rtol=0)


def test_issue40_longrope_takes_the_long_factors_past_the_trained_context(tmp_path: Path) -> None:
    """Positions from original_max_position_embeddings on rotate by the long factors: a prompt that
    crosses it differs from the short-factor rope there, and cached equals uncached across the line."""
    from mlxcel.layers.rope import RotaryEmbedding

    scaling = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [3.0] * 4,
               "original_max_position_embeddings": 8, "max_position_embeddings": 64}
    table = RotaryEmbedding(8, 10000.0, scaling)
    short = RotaryEmbedding(8, 10000.0, {**scaling, "long_factor": [1.0] * 4})
    positions = torch.arange(16)
    cos, _ = table.cos_sin(positions, torch.float32)
    cos_short, _ = short.cos_sin(positions, torch.float32)
    torch.testing.assert_close(cos[:8], cos_short[:8])
    assert (cos[8:] - cos_short[8:]).abs().max() > 1e-3
    config = FAMILIES["phi3"][1]()
    config.original_max_position_embeddings = 8
    config.rope_parameters["original_max_position_embeddings"] = 8
    save_tiny_hf(config, tmp_path)
    ours = load_model(tmp_path, device=DEVICE).model
    prompt = PROMPTS[-1]
    torch.testing.assert_close(cached_logits(ours, prompt, (6, 5)), uncached_logits(ours, prompt),
                               atol=TOL_SAME_MATH, rtol=0)


def test_issue40_mla_caches_the_latent_not_the_heads() -> None:
    """DeepSeek-V3's KV cache is one latent head a token (kv_lora_rank + rope dims), not H full heads."""
    from mlxcel.engine.loop import ModelShape
    from mlxcel.models import deepseek_v3

    args = deepseek_v3.ModelArgs.from_dict(FAMILIES["deepseek_v3"][1]().to_dict())
    shape = ModelShape.of(args)
    assert (shape.num_kv_heads, shape.head_dim) == (1, 16 + 8)
    # The latent is stored once (values are keys): half the bytes of a K + V cache of that width.
    assert shape.values_are_keys and shape.kv_bytes_per_token("f16", "f16") == 2 * (16 + 8) * 2
    cache = ModelShape(2, 1, 32, 64, values_are_keys=True).kv_cache(4, 4, torch.float32, "cpu", "q8_0", "f16")
    assert list(cache.stacked_tensors()) == ["k", "k_scales"] and cache.v_type == "q8_0"
    assert cache.bytes_per_token == 2 * 32 * (1 + 2 / 32) and cache.v[1] is cache.k[1]


def test_issue40_gemma4_kv_shared_layers_keep_no_kv_and_global_layers_their_own_width() -> None:
    """Gemma 4's layers 2 and 3 reuse layers 0 and 1's KV: the cache holds two layers, one of each head shape,
    and the memory a token costs counts those two only; the shared layers have no k/v projections."""
    from mlxcel.engine.loop import ModelShape
    from mlxcel.models import gemma4_text

    args = gemma4_text.ModelArgs.from_dict(FAMILIES["gemma4"][1]().to_dict())
    shape = ModelShape.of(args)
    assert (shape.num_layers, shape.layer_shapes, shape.num_shared_layers) == (2, ((2, 16), (1, 32)), 2)
    assert shape.kv_bytes_per_token("f32", "f32") == 4 * 2 * (2 * 16 + 1 * 32)
    cache = shape.kv_cache(4, 4, torch.float32, "cpu", "f32", "f32")
    assert [tuple(t.shape[1:]) for t in cache.k] == [(2, 16), (1, 32)] and cache.bytes_per_token == 4 * 2 * 64
    model = gemma4_text.Model(args)
    assert [layer.kv_index for layer in model.model.layers] == [0, 1, 0, 1]
    assert [hasattr(layer.self_attn, "k_proj") for layer in model.model.layers] == [True, True, False, False]
    assert not hasattr(model.model.layers[1].self_attn, "v_proj")  # attention_k_eq_v: values are k_proj's


def test_issue40_gemma4_multimodal_checkpoint_serves_its_text_model(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A Gemma4ForConditionalGeneration checkpoint loads its text model (logits equal transformers' on text)
    and says in one line that its vision tower is not served."""
    text = FAMILIES["gemma4"][1]().to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64, pooling_kernel_size=2)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None, image_token_id=100,
                                       boi_token_id=101, eoi_token_id=102, video_token_id=103, audio_token_id=104,
                                       boa_token_id=105, eoa_token_index=106)
    reference = save_tiny_hf(config, tmp_path)
    with caplog.at_level("INFO", logger="mlxcel.models.gemma4_text"):
        loaded = load_model(tmp_path, device=DEVICE)
    assert loaded.model_type == "gemma4_text"
    assert any("serving text only" in r.message and "vision_tower" in r.message for r in caplog.records)
    for prompt in PROMPTS[2:]:
        torch.testing.assert_close(uncached_logits(loaded.model, prompt), reference_logits(reference, prompt),
                                   atol=TOL_VS_TRANSFORMERS, rtol=0)
