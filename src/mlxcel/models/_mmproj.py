"""What every family's `attach_mmproj` (issue 43, loading/mmproj.py) shares: the ViT tower's settings from
llama.cpp's `clip.vision.*` keys, and its tensors under llama.cpp's names (`v.patch_embd`, `v.blk.N.attn_q`,
...; tools/mtmd/clip-impl.h) mapped to layers/vision.py's `VisionTransformer`, built and loaded."""

from __future__ import annotations

from typing import Any

import torch

from mlxcel.layers.vision import VisionRecipe, VisionTransformer

_NAMES = {"v.patch_embd": "embeddings.patch_embedding", "v.position_embd": "embeddings.position_embedding",
          "v.pre_ln": "pre_layrnorm", "v.post_ln": "post_layernorm"}
_LAYER_NAMES = {"ln1": "layer_norm1", "ln2": "layer_norm2", "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj",
                "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}


def clip_value(mmproj: Any, key: str, default: Any = None) -> Any:
    """A `clip.vision.<key>` value of the file; KeyError naming it where it is absent and has no default."""
    value = mmproj.metadata.get(f"clip.vision.{key}", default)
    if value is None:
        raise KeyError(f"the file has no clip.vision.{key}")
    return value


def vision_config(mmproj: Any, default_eps: float = 1e-6) -> dict[str, Any]:
    """The tower's HF-style vision_config from the file's `clip.vision.*` keys."""
    return {"hidden_size": int(clip_value(mmproj, "embedding_length")),
            "num_hidden_layers": int(clip_value(mmproj, "block_count")),
            "num_attention_heads": int(clip_value(mmproj, "attention.head_count")),
            "intermediate_size": int(clip_value(mmproj, "feed_forward_length")),
            "image_size": int(clip_value(mmproj, "image_size")), "patch_size": int(clip_value(mmproj, "patch_size")),
            "layer_norm_eps": float(clip_value(mmproj, "attention.layer_norm_epsilon", default_eps))}


def tensor(mmproj: Any, name: str) -> torch.Tensor:
    """One tensor of the file, dequantized to float32."""
    return torch.from_numpy(mmproj.dequantize(name).copy())


def load_tower(mmproj: Any, config: dict[str, Any], like: torch.Tensor, **choices: Any) -> VisionTransformer:
    """The file's `v.*` tower as a VisionTransformer (`choices`: VisionRecipe's), on `like`'s device and dtype."""
    tower = VisionTransformer(VisionRecipe.from_config(config, **choices))
    names = dict(_NAMES)
    for i in range(int(config["num_hidden_layers"])):
        names |= {f"v.blk.{i}.{ours}": f"encoder.layers.{i}.{theirs}" for ours, theirs in _LAYER_NAMES.items()}
    state = {f"{ours}.{kind}": tensor(mmproj, f"{theirs}.{kind}") for theirs, ours in names.items()
             for kind in ("weight", "bias") if f"{theirs}.{kind}" in mmproj.tensors}
    if "v.class_embd" in mmproj.tensors:  # CLIP's class token (a bare parameter: no .weight)
        state["embeddings.class_embedding"] = tensor(mmproj, "v.class_embd")
    tower.load_state_dict(_unswapped_ffn(state, int(config["intermediate_size"])), strict=True)
    return tower.to(like.device, like.dtype).eval()


def _unswapped_ffn(state: dict[str, torch.Tensor], intermediate: int) -> dict[str, torch.Tensor]:
    """NOTE: llama.cpp's legacy CLIP converter (LLaVA 1.5) names fc1 `ffn_down` and fc2 `ffn_up`; clip.cpp
    tells them apart by shape, and so do we: fc1's weight is [intermediate, hidden]."""
    out = dict(state)
    for name, value in state.items():
        if name.endswith("mlp.fc1.weight") and value.shape[0] != intermediate:
            stem = name.removesuffix("fc1.weight")
            for kind in ("weight", "bias"):
                if f"{stem}fc1.{kind}" in state:
                    out[f"{stem}fc1.{kind}"], out[f"{stem}fc2.{kind}"] = state[f"{stem}fc2.{kind}"], state[f"{stem}fc1.{kind}"]
    return out
