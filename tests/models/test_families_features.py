"""Issue 40: server features on representative families in the real engine, against transformers.

- KV quantization (`--cache-type-k/v q8_0`): gemma2 (soft-capping, sliding), phi3 (fused checkpoint
  projections, partial rotary), qwen3_moe (q/k norms, experts) and deepseek_v3 (MLA: the quantized
  latent is its only cache tensor), with the cache really quantized, give the same 16 greedy tokens
  alone, in a batch and after a prefix-cache hit, and those start as transformers' float32 greedy
  tokens (q8_0's rounding, ~1e-2 on the logits, may flip a later near-tie: phi3's 9th token does).
- LoRA where the projections exist (peft's own adapters, the reference being the peft model):
  gemma2 (q/k/v/o, gate/up/down), phi3 (o_proj, down_proj: its qkv_proj and gate_up_proj are fused),
  qwen3_moe (attention projections; experts are stacked tensors), deepseek_v3 (o_proj: MLA's other
  projections are not LoRA targets here, and peft makes gate/up/down expert-parameter LoRA).

Head sizes are 32 here: q8_0 quantizes blocks of 32 values.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mlxcel.engine.client import EngineClient
from mlxcel.layers.lora import apply_adapters, load_adapter, token_scales
from mlxcel.loading import load_model
from mlxcel.types import Request, SamplingParams

from .harness import save_tiny_hf, uncached_logits
from .test_families import COMMON, VOCAB
from .test_families_engine import _engine, transformers_greedy

NUM_TOKENS = 16
SCALE = 1.0
AGREED = 8  # q8_0 tokens that must equal transformers' float32 ones
_rng = random.Random(11)
PROMPTS = [[_rng.randrange(1, VOCAB) for _ in range(n)] for n in (6, 11, 19)]

CONFIGS = {
    "gemma2": lambda: transformers.Gemma2Config(
        **{**COMMON, "num_hidden_layers": 2}, head_dim=32, query_pre_attn_scalar=32, sliding_window=4,
        attn_logit_softcapping=5.0, final_logit_softcapping=None),
    "phi3": lambda: transformers.Phi3Config(
        **{**COMMON, "num_attention_heads": 2, "num_key_value_heads": 1}, partial_rotary_factor=0.5, pad_token_id=0),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, moe_intermediate_size=32, pad_token_id=0),
}
LORA_TARGETS = {
    "gemma2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "phi3": ["o_proj", "down_proj"],
    "qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "deepseek_v3": ["o_proj"],  # peft turns gate/up/down into expert-parameter LoRA, which is not served
}


async def _generate(client: EngineClient, request_id: str, prompt: list[int],
                    lora_scales: tuple[float, ...] = ()) -> tuple[list[int], int]:
    tokens, cached = [], 0
    sampling = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    async for event in client.generate(Request(request_id, prompt, sampling, lora_scales=lora_scales)):
        tokens.extend(event.token_ids)
        cached = event.num_cached_tokens or cached
    return tokens, cached


def _alone_batched_and_hit(client: EngineClient, tag: str, **fields: Any) -> list[list[list[int]]]:
    """Tokens of the last prompt alone, then of every prompt batched, then batched again (prefix hits)."""
    async def batch(name: str) -> list[tuple[list[int], int]]:
        return list(await asyncio.gather(*(_generate(client, f"{tag}{name}{i}", p, **fields)
                                           for i, p in enumerate(PROMPTS))))

    alone, _ = asyncio.run(_generate(client, f"{tag}alone", PROMPTS[-1], **fields))
    batched = asyncio.run(batch("batch"))
    again = asyncio.run(batch("again"))
    assert [cached for _, cached in again] == [(len(p) - 1) // 4 * 4 for p in PROMPTS]
    return [[alone], [t for t, _ in batched], [t for t, _ in again]]


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    folder = tmp_path_factory.mktemp(request.param)
    reference = save_tiny_hf(CONFIGS[request.param](), folder)
    return request.param, folder, reference


def test_issue40_q8_0_kv_cache_keeps_transformers_greedy_tokens(family: tuple[str, Path, Any]) -> None:
    name, folder, reference = family
    expected = [transformers_greedy(reference, p) for p in PROMPTS]
    client = _engine(load_model(folder).model, cache_type_k="q8_0", cache_type_v="q8_0")
    try:
        cache = client.core.kv_cache
        assert cache.k_type == cache.v_type == "q8_0" and cache.k_scales is not None
        assert cache.values_are_keys == (name == "deepseek_v3")
        alone, batched, again = _alone_batched_and_hit(client, "q8")
        assert alone == [batched[-1]] and again == batched
        for got, want in zip(batched, expected):
            assert got[:AGREED] == want[:AGREED]
    finally:
        client.core.stop(10)


@pytest.mark.slow  # peft builds and runs the reference: ~10 s a family on 2 busy cores
def test_issue40_lora_adapter_equals_peft_in_the_engine(family: tuple[str, Path, Any], tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from tests.layers.peft_adapters import make_adapter, peft_greedy, set_peft_scale

    name, folder, _ = family
    adapter_dir = tmp_path / "adapter"
    # alpha 32 / r 4: a strong update over peft's random A, B ~ N(0, 0.15)
    reference = make_adapter(folder, adapter_dir, r=4, alpha=32, targets=LORA_TARGETS[name], seed=3)
    expected = [peft_greedy(reference, p, SCALE, NUM_TOKENS) for p in PROMPTS]
    base = [peft_greedy(reference, p, 0.0, NUM_TOKENS) for p in PROMPTS]
    model = load_model(folder).model
    rows = apply_adapters(model, [load_adapter(adapter_dir)])
    # The adapter acts, and as peft's does, on the logits (gemma2's tokens here follow the scaled
    # embedding whatever the adapter adds, so the tokens alone would not show it).
    prompt = PROMPTS[-1]
    rows.set_rows(token_scales(rows, [(SCALE,)], [len(prompt)], torch.device("cpu")))
    ours = uncached_logits(model, prompt)
    set_peft_scale(reference, SCALE)
    with torch.inference_mode():
        want = reference(torch.tensor([prompt])).logits[0]
        set_peft_scale(reference, 0.0)
        unadapted = reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, want, atol=2e-5, rtol=0)
    assert (want - unadapted).abs().max() > 1e-2
    client = _engine(model)
    try:
        alone, batched, again = _alone_batched_and_hit(client, "lora", lora_scales=(SCALE,))
        assert alone == [expected[-1]] and batched == expected and again == expected
        plain, _ = asyncio.run(_generate(client, "base", PROMPTS[0], lora_scales=(0.0,)))
        assert plain == base[0]
    finally:
        client.core.stop(10)
