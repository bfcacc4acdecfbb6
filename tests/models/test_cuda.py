"""The real-checkpoint comparisons on CUDA in bfloat16 (issue 2, run on the lent GPU).

Reference: transformers on the same GGUF in float32 on the same GPU. Yardstick: transformers
itself in bfloat16. Stated tolerances, per model, over the 5 prompts' compared positions:
- top-1 agreement of our bf16 logits with the float32 reference >= MIN_TOP1, and no more
  than TOP1_SLACK below transformers' own bf16 agreement;
- max |logit error| of our bf16 run <= ERROR_RATIO x transformers' bf16 error (+ ERROR_FLOOR);
- greedy (64 tokens, prompt 0, through our paged KV cache on the GPU): the first
  NUM_GREEDY_EQUAL tokens equal the float32 reference's, or at least as many as
  transformers' bf16 run keeps (bf16 flips near-ties: on CPU bf16 both runs of Gemma
  leave the float32 path at token 13, both runs of SmolLM2 at token 16).
Each model prints one line with the figures (pytest -s).
Measured on CPU in bf16 (same code path): SmolLM2 max err 1.36 (transformers bf16: 1.55),
top-1 0.977 (0.962); Gemma 3 max err 2.33 (1.88), top-1 0.987 (0.987).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from mlxcel.loading import load_model

from .harness import compared_positions, greedy, real_prompts, uncached_hidden

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MIN_TOP1 = 0.95
TOP1_SLACK = 0.02
ERROR_RATIO = 1.5
ERROR_FLOOR = 0.05
NUM_GREEDY = 64
NUM_GREEDY_EQUAL = 16


@torch.inference_mode()
def measure(name: str, path: Path, device: str) -> dict[str, Any]:
    """Figures for one model: ours and transformers in bf16, each against transformers in fp32."""
    import transformers

    kw = {"gguf_file": path.name}
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), **kw)
    ref32 = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kw)
    ref32 = ref32.to(device).eval()
    ref16 = copy.deepcopy(ref32).to(torch.bfloat16)
    ours = load_model(path, device=device, dtype=torch.bfloat16).model
    prompts = real_prompts(name, tokenizer)
    figures = _logit_figures(prompts, ours, ref32, ref16, device)
    figures.update(_greedy_figures(prompts[0], ours, ref32, ref16, tokenizer.eos_token_id, device))
    return figures


def _logit_figures(prompts: list[list[int]], ours: nn.Module, ref32: nn.Module, ref16: nn.Module,
                   device: str) -> dict[str, Any]:
    err_ours = err_hf = 0.0
    agree_ours = agree_hf = total = 0
    for ids in prompts:
        rows = compared_positions(len(ids))
        batch = torch.tensor([ids], device=device)
        truth = ref32(batch, logits_to_keep=rows.to(device)).logits[0].float()
        theirs = ref16(batch, logits_to_keep=rows.to(device)).logits[0].float()
        mine = ours.compute_logits(uncached_hidden(ours, ids)[rows.to(device)]).float()
        err_ours = max(err_ours, float((mine - truth).abs().max()))
        err_hf = max(err_hf, float((theirs - truth).abs().max()))
        agree_ours += int((mine.argmax(-1) == truth.argmax(-1)).sum())
        agree_hf += int((theirs.argmax(-1) == truth.argmax(-1)).sum())
        total += len(rows)
    return {"max_err_ours": err_ours, "max_err_hf_bf16": err_hf,
            "top1_ours": agree_ours / total, "top1_hf_bf16": agree_hf / total, "positions": total}


def _greedy_figures(prompt: list[int], ours: nn.Module, ref32: nn.Module, ref16: nn.Module,
                    eos: int | None, device: str) -> dict[str, Any]:
    batch = torch.tensor([prompt], device=device)
    generate = lambda m: m.generate(batch, do_sample=False, max_new_tokens=NUM_GREEDY,  # noqa: E731
                                    pad_token_id=eos)[0, len(prompt):].tolist()
    truth, theirs = generate(ref32), generate(ref16)
    mine = greedy(ours, prompt, NUM_GREEDY)
    return {"greedy_equal_ours": _common_prefix(mine, truth), "greedy_equal_hf_bf16": _common_prefix(theirs, truth),
            "greedy_len_reference": len(truth)}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def check(name: str, device: str, f: dict[str, Any]) -> None:
    """Print the figures, then hold them to the stated tolerances."""
    print(f"{name} bf16 on {device}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                              for k, v in f.items()))
    assert f["top1_ours"] >= MIN_TOP1
    assert f["top1_ours"] >= f["top1_hf_bf16"] - TOP1_SLACK
    assert f["max_err_ours"] <= ERROR_RATIO * f["max_err_hf_bf16"] + ERROR_FLOOR
    assert f["greedy_equal_ours"] >= min(NUM_GREEDY_EQUAL, f["greedy_equal_hf_bf16"])


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_a2_real_models_bf16_on_cuda(name: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(f"{name}_path")
    check(name, "cuda", measure(name, path, "cuda"))
