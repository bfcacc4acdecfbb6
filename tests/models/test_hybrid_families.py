"""Issue 41 (part B): the Mamba-2, short-conv and RG-LRU hybrids from tiny random checkpoints that
transformers writes: logits equal transformers' float32 forward, 16 greedy tokens equal its greedy
tokens with the recurrent states carried explicitly (a state slot a sequence beside the paged KV
cache), a prompt prefilled in chunks equals the prompt in one piece, and a batch of mixed lengths
gives each prompt its own logits (one mixed prefill step, then all decoding together).

Tolerances as in test_families.py: 2e-5 against transformers, 1e-5 between our own paths."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import transformers
from torch import nn

from mlxcel.loading import load_model

from .harness import batch_uncached_logits, cached_logits, greedy, lockstep_cached_logits, save_tiny_hf, uncached_logits
from .recurrent_harness import HybridSequences

VOCAB = 128
TOL_VS_TRANSFORMERS = 2e-5
TOL_SAME_MATH = 1e-5
MAMBA = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
             max_position_embeddings=256)

# family id -> (model_type, transformers config). Mamba-2 chunks of 8 positions: the prompts span several.
FAMILIES: dict[str, tuple[str, Callable[[], Any]]] = {
    # M, *, -, M: Mamba-2 (2 groups of 4 heads), attention without rope, a relu^2 MLP.
    "nemotron_h": ("nemotron_h", lambda: transformers.NemotronHConfig(
        **MAMBA, layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
        head_dim=16, intermediate_size=128, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
        chunk_size=8)),
    # Nemotron 3 Nano's shape (issue 41 part 2): M, E, *, E: MoE layers of 8 ungated relu^2 experts (top-2 within the
    # best of 2 groups, sigmoid scores with the selection bias, renormalised, times 2.5) plus the ungated shared expert.
    "nemotron_h-moe": ("nemotron_h", lambda: transformers.NemotronHConfig(
        **MAMBA, layers_block_type=["mamba", "moe", "attention", "moe"], head_dim=16, intermediate_size=128,
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=8, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5)),
    # Mamba-2 then rope attention, each followed by 8 experts (top-2) plus the shared MLP; Granite's multipliers.
    "granitemoehybrid": ("granitemoehybrid", lambda: transformers.GraniteMoeHybridConfig(
        **MAMBA, num_hidden_layers=2, layer_types=["mamba", "attention"], intermediate_size=32,
        num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=48, position_embedding_type="rope",
        mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8,
        embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=4.0)),
    # No experts (the shared MLP alone) and no rope.
    "granitemoehybrid-dense-nope": ("granitemoehybrid", lambda: transformers.GraniteMoeHybridConfig(
        **MAMBA, num_hidden_layers=2, layer_types=["attention", "mamba"], intermediate_size=32,
        num_local_experts=0, shared_intermediate_size=48, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
        mamba_n_groups=1, mamba_chunk_size=8)),
    # conv, attention, conv: the short conv's window of 3; the feed-forward width auto-adjusted (2/3, multiple of 32).
    "lfm2": ("lfm2", lambda: transformers.Lfm2Config(
        **MAMBA, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], intermediate_size=144,
        block_multiple_of=32, conv_L_cache=3, conv_bias=True)),
    # recurrent, recurrent, local attention (a window of 6, shorter than the prompts); rope over half a head.
    "recurrent_gemma": ("recurrent_gemma", lambda: transformers.RecurrentGemmaConfig(
        **MAMBA, num_hidden_layers=3, head_dim=16, lru_width=64, intermediate_size=128, attention_window_size=6,
        conv1d_width=4, logits_soft_cap=5.0)),
    # Attention beside Mamba-2 in every layer, every muP multiplier away from 1, biases on, the gated norm on.
    "falcon_h1": ("falcon_h1", lambda: transformers.FalconH1Config(
        **MAMBA, num_hidden_layers=2, head_dim=16, intermediate_size=96, mamba_d_ssm=64, mamba_n_heads=4,
        mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8, mamba_rms_norm=True,
        mamba_norm_before_gate=False, mamba_proj_bias=True, projectors_bias=True, attention_bias=True, mlp_bias=True,
        embedding_multiplier=2.0, lm_head_multiplier=0.5, attention_in_multiplier=0.7, attention_out_multiplier=1.3,
        key_multiplier=0.6, ssm_in_multiplier=1.2, ssm_out_multiplier=0.8, ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.7],
        mlp_multipliers=[1.5, 0.6])),
    # Falcon-H1's default Mamba: no gated norm (y * silu(z)), norm before gate unused.
    "falcon_h1-no-norm": ("falcon_h1", lambda: transformers.FalconH1Config(
        **MAMBA, num_hidden_layers=2, head_dim=16, intermediate_size=96, mamba_d_ssm=64, mamba_n_heads=4,
        mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=8, ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.7])),
}

# Settings a main family's tests already run through the engine paths; these variants are checked by logits.
VARIANTS = ("granitemoehybrid-dense-nope", "falcon_h1-no-norm")
MAIN = [f for f in FAMILIES if f not in VARIANTS]

_rng = random.Random(3)
PROMPTS = [[_rng.randrange(VOCAB) for _ in range(n)] for n in (3, 8, 21)]


@dataclass
class Tiny:
    family: str
    reference: nn.Module
    ours: nn.Module
    model_type: str


@pytest.fixture(scope="module")
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    folder: Path = tmp_path_factory.mktemp(request.param)
    reference = save_tiny_hf(FAMILIES[request.param][1](), folder)
    loaded = load_model(folder)
    return Tiny(request.param, reference, loaded.model, loaded.model_type)


@torch.inference_mode()
def reference_logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("tiny", list(FAMILIES), indirect=True)
def test_issue41_logits_equal_transformers(tiny: Tiny) -> None:
    assert tiny.model_type == FAMILIES[tiny.family][0]
    for prompt in PROMPTS:
        torch.testing.assert_close(uncached_logits(tiny.ours, prompt), reference_logits(tiny.reference, prompt),
                                   atol=TOL_VS_TRANSFORMERS, rtol=0)


@pytest.mark.parametrize("tiny", MAIN, indirect=True)
@torch.inference_mode()
def test_issue41_greedy_tokens_with_carried_state_equal_transformers(tiny: Tiny) -> None:
    prompt = PROMPTS[0]  # short: transformers recomputes the whole sequence for each of the 16 tokens
    ids = list(prompt)
    for _ in range(16):
        ids.append(int(reference_logits(tiny.reference, ids)[-1].argmax()))
    assert greedy(tiny.ours, prompt, 16, HybridSequences) == ids[len(prompt):]


@pytest.mark.parametrize("tiny", MAIN, indirect=True)
def test_issue41_chunked_prefill_equals_one_piece(tiny: Tiny) -> None:
    """Chunks of 6, 5 and 9 tokens (across Mamba-2's 8-position chunks), then one token a step."""
    prompt = PROMPTS[-1]
    whole = uncached_logits(tiny.ours, prompt)
    torch.testing.assert_close(cached_logits(tiny.ours, prompt, (6, 5, 9), HybridSequences), whole,
                               atol=TOL_SAME_MATH, rtol=0)
    torch.testing.assert_close(cached_logits(tiny.ours, prompt, (21,), HybridSequences), whole,
                               atol=TOL_SAME_MATH, rtol=0)


@pytest.mark.parametrize("tiny", MAIN, indirect=True)
def test_issue41_batch_of_mixed_lengths_gives_each_prompt_its_own_logits(tiny: Tiny) -> None:
    alone = [uncached_logits(tiny.ours, p) for p in PROMPTS]
    for got, want in zip(batch_uncached_logits(tiny.ours, PROMPTS), alone):
        torch.testing.assert_close(got, want, atol=TOL_SAME_MATH, rtol=0)
    for got, want in zip(lockstep_cached_logits(tiny.ours, PROMPTS, 3, HybridSequences), alone):
        torch.testing.assert_close(got, want, atol=TOL_SAME_MATH, rtol=0)
