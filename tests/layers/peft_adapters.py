"""LoRA adapters built by peft itself over a base checkpoint (random A and B, saved in PEFT's layout),
and greedy decoding through the peft model: the reference every F8 test compares with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: Path, out: Path, *, r: int, alpha: float, rslora: bool = False,
                 targets: list[str] = TARGETS, seed: int = 0) -> Any:
    """A random peft LoRA over the base model, saved to `out`; returns the peft model (the reference)."""
    import peft
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                             use_rslora=rslora, lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:  # moderate updates: the adapter changes tokens without swamping the base
                param.normal_(0.0, 0.15)
    model.save_pretrained(str(out))
    return model.eval()


def set_peft_scale(model: Any, scale: float) -> None:
    import peft

    for module in model.modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.set_scale("default", scale)


@torch.inference_mode()
def peft_greedy(model: Any, prompt: list[int], scale: float, num_tokens: int,
                eos_token_id: int | None = None) -> list[int]:
    """`num_tokens` greedy tokens of the peft model at `scale` (ending with `eos_token_id` if it comes first)."""
    set_peft_scale(model, scale)
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        if ids[-1] == eos_token_id:
            break
    return ids[len(prompt):]
