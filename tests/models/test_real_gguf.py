"""Real checkpoints against transformers loading the same GGUF, float32 on CPU (A2, issues 2 and 11).

SmolLM2-135M-Instruct (llama, Q4_1), Gemma 3 270M (gemma3, Q4_K_M, sliding window 512) and,
where their packages are installed (not by the default setup: 1.7 GB), Qwen2.5-Coder-0.5B and
-1.5B-Instruct (qwen2, Q4_K_M with Q6_K tensors, biased q/k/v projections) are dequantized by both sides; the model code is the only difference. Checks: per-position
logits on 5 prompts (for Gemma one is longer than its 512-token window) within TOL, and a
64-token greedy continuation through our paged KV cache token-for-token equal to
transformers' `generate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from mlxcel.loading import load_model

from .harness import compared_positions, greedy, packaged_gguf, real_prompts, uncached_hidden

pytestmark = pytest.mark.slow

# Max |ours - transformers| over every compared logit (float32). Measured on CPU: 0.0 for both
# (bit-identical, every prompt); the margin allows another BLAS or thread count.
TOL = {"smollm2": 1e-5, "gemma3": 1e-5, "qwen2.5-coder-0.5b-instruct": 1e-4, "qwen2.5-coder-1.5b-instruct": 1e-4}
QWEN_CODERS = ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
NUM_GREEDY = 64


@dataclass
class Pair:
    name: str
    ours: nn.Module
    reference: nn.Module
    tokenizer: Any
    prompts: list[list[int]]


@pytest.fixture(scope="module", params=["smollm2", "gemma3", *QWEN_CODERS])
def pair(request: pytest.FixtureRequest) -> Pair:
    transformers = pytest.importorskip("transformers")
    if request.param in QWEN_CODERS:
        path = packaged_gguf(request.param)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    else:
        path: Path = request.getfixturevalue(f"{request.param}_path")
        tokenizer = request.getfixturevalue(f"{request.param}_reference")  # converted once per session
    if request.param == "smollm2":  # the session's copy, also the LoRA tests' base (only read here)
        reference = request.getfixturevalue("smollm2_transformers")
    else:
        reference = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                      dtype=torch.float32)
    ours = load_model(path, dtype=torch.float32).model
    return Pair(request.param, ours, reference.eval(), tokenizer, real_prompts(request.param, tokenizer))


@torch.inference_mode()
def both_logits(pair: Pair, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = compared_positions(len(ids))
    theirs = pair.reference(torch.tensor([ids]), logits_to_keep=rows).logits[0]
    return pair.ours.compute_logits(uncached_hidden(pair.ours, ids)[rows]), theirs


def test_a2_logits_match_transformers_on_five_prompts(pair: Pair) -> None:
    assert len(pair.prompts) >= 5
    worst = 0.0
    for ids in pair.prompts:
        ours, theirs = both_logits(pair, ids)
        worst = max(worst, float((ours - theirs).abs().max()))
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1)), f"{pair.name}: top-1 differs on {ids[:8]}..."
    print(f"{pair.name}: max |logit diff| over {len(pair.prompts)} prompts = {worst:.2e}")
    assert worst <= TOL[pair.name]


@torch.inference_mode()
def test_a2_greedy_64_tokens_equal_transformers(pair: Pair) -> None:
    prompt = pair.prompts[0]
    out = pair.reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NUM_GREEDY,
                                  pad_token_id=pair.tokenizer.eos_token_id)
    theirs = out[0, len(prompt):].tolist()
    assert len(theirs) == NUM_GREEDY  # no end-of-sequence token cut the reference short
    assert greedy(pair.ours, prompt, NUM_GREEDY) == theirs
