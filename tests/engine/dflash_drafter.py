"""A DFlash drafter checkpoint made for the tests (B3): z-lab's layout, random weights.

No trained DFlash drafter can be had here (they live on a model hub), so the tests build one in
the same layout (config.json with `dflash_config`, model.safetensors) for the target they run:
it drafts (badly: its weights are random), and everything around it is exercised for real.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from mlxcel.engine.spec.dflash import CONFIG_FILE, DFlashModel, DFlashSpec


def write_dflash_drafter(directory: Path, target_args, *, target_layer_ids: tuple[int, ...],  # noqa: ANN001
                         mask_token_id: int, num_layers: int = 1, block_size: int = 8, seed: int = 0,
                         std: float = 0.3) -> Path:
    """A random DFlash drafter for a target with `target_args` (its ModelArgs), saved to `directory`."""
    heads = target_args.num_attention_heads
    spec = DFlashSpec(hidden_size=target_args.hidden_size, num_layers=num_layers, num_heads=heads,
                      num_kv_heads=target_args.num_key_value_heads, head_dim=target_args.hidden_size // heads,
                      intermediate_size=2 * target_args.hidden_size, rms_norm_eps=1e-6, rope_theta=10000.0,
                      rope_scaling=None, attention_bias=False, target_layer_ids=target_layer_ids,
                      mask_token_id=mask_token_id, block_size=block_size)
    torch.manual_seed(seed)
    model = DFlashModel(spec)
    for name, p in model.named_parameters():
        torch.nn.init.normal_(p, std=std) if not name.endswith("norm.weight") else torch.nn.init.ones_(p)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(spec.to_config(), indent=1))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    return directory
