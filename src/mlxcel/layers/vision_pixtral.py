"""The Pixtral vision tower and Mistral 3's projector (Mistral Small 3.x).

Pixtral is a ViT over each image at its own size (a multiple of the patch size): a bias-free patch
convolution, an RMSNorm, then pre-norm layers (RMSNorm, attention with the 2-D rotary, RMSNorm,
gated MLP), each image attending to itself only. Mistral 3's projector normalises the patch states,
folds each m x m block of patches into one row (`patch_merger`), and maps it through two linears
into the language model's width.

    images [C, H_i, W_i] -> patches (row-major per image) -> layers -> [sum h_i w_i, hidden]
    -> projector -> [sum h_i w_i / m^2, text hidden] (row-major blocks per image)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mlxcel.layers.decoder import MLP, MLPRecipe, activation
from mlxcel.layers.norm import RMSNorm
from mlxcel.layers.patch_attention import axial_rope, segment_attention
from mlxcel.layers.rope import apply_rope


@dataclass(frozen=True)
class PixtralSpec:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int
    head_dim: int
    num_channels: int = 3
    hidden_act: str = "gelu"
    rope_theta: float = 10000.0

    @staticmethod
    def of(config: dict[str, Any]) -> PixtralSpec:
        rope = config.get("rope_parameters") or {}
        heads = int(config["num_attention_heads"])
        return PixtralSpec(
            int(config["hidden_size"]), int(config["num_hidden_layers"]), heads, int(config["intermediate_size"]),
            int(config["patch_size"]), int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            int(config.get("num_channels", 3)), str(config.get("hidden_act", "gelu")),
            float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))


class PixtralAttention(nn.Module):
    def __init__(self, spec: PixtralSpec) -> None:
        super().__init__()
        self.num_heads, self.head_dim = spec.num_attention_heads, spec.head_dim
        width = spec.num_attention_heads * spec.head_dim
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, nn.Linear(spec.hidden_size, width, bias=False))
        self.o_proj = nn.Linear(width, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], bounds: tuple[int, ...]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (p(x).view(n, self.num_heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = (apply_rope(y, *rope) for y in (q, k))
        return self.o_proj(segment_attention(q, k, v, bounds, self.head_dim**-0.5).reshape(n, -1))


class PixtralLayer(nn.Module):
    def __init__(self, spec: PixtralSpec) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(spec.hidden_size, 1e-5), RMSNorm(spec.hidden_size, 1e-5)
        self.attention = PixtralAttention(spec)
        self.feed_forward = MLP(spec.hidden_size, MLPRecipe(spec.intermediate_size, spec.hidden_act))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], bounds: tuple[int, ...]) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, bounds)
        return x + self.feed_forward(self.ffn_norm(x), None)


class PixtralTransformer(nn.Module):
    def __init__(self, spec: PixtralSpec) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PixtralLayer(spec) for _ in range(spec.num_hidden_layers))


class PixtralTower(nn.Module):
    """The checkpoint's `vision_tower`: images -> patch states [sum h_i * w_i, hidden] and the grids (h_i, w_i)."""

    def __init__(self, spec: PixtralSpec) -> None:
        super().__init__()
        self.spec = spec
        self.patch_conv = nn.Conv2d(spec.num_channels, spec.hidden_size, spec.patch_size, spec.patch_size, bias=False)
        self.ln_pre = RMSNorm(spec.hidden_size, 1e-5)
        self.transformer = PixtralTransformer(spec)

    def rope(self, grids: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows turn at the even frequencies of head_dim's rotary, columns at the odd ones."""
        freqs = 1.0 / (self.spec.rope_theta ** (torch.arange(0, self.spec.head_dim, 2, dtype=torch.float) / self.spec.head_dim))
        positions = torch.cat([torch.cartesian_prod(torch.arange(h), torch.arange(w)) for h, w in grids])
        return axial_rope(positions, freqs[0::2].to(device), freqs[1::2].to(device))

    def forward(self, images: list[torch.Tensor], feature_layer: int = -1) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """images: each [C, H, W]; `feature_layer` as HF indexes hidden states (0: after ln_pre, -1: the last layer)."""
        weight = self.patch_conv.weight
        patches = [self.patch_conv(image.to(weight.dtype).unsqueeze(0))[0] for image in images]  # [hidden, h, w]
        grids = [(p.shape[1], p.shape[2]) for p in patches]
        x = self.ln_pre(torch.cat([p.flatten(1).T for p in patches]))
        bounds = tuple(torch.tensor([0] + [h * w for h, w in grids]).cumsum(0).tolist())
        rope = self.rope(grids, x.device)
        layers = self.transformer.layers
        for layer in layers[:feature_layer % (len(layers) + 1)]:
            x = layer(x, rope, bounds)
        return x, grids


class Mistral3Projector(nn.Module):
    """The checkpoint's `multi_modal_projector`: norm, m x m patch merging, linear_1, activation, linear_2."""

    def __init__(self, vision_hidden: int, text_hidden: int, merge: int, eps: float, act: str, bias: bool) -> None:
        super().__init__()
        self.merge, self.act = merge, activation(act)
        self.norm = RMSNorm(vision_hidden, eps)
        self.patch_merger = nn.Module()
        self.patch_merger.merging_layer = nn.Linear(vision_hidden * merge**2, vision_hidden, bias=False)
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        x, m, blocks = self.norm(patches), self.merge, []
        for image, (h, w) in zip(x.split([h * w for h, w in grids]), grids):
            grid = image.view(h, w, -1).permute(2, 0, 1).unsqueeze(0)  # [1, d, h, w]
            # [1, d * m * m, blocks] (channel-major, then the block's row and column) -> [blocks, d * m * m]
            blocks.append(F.unfold(grid, kernel_size=m, stride=m)[0].T)
        x = self.patch_merger.merging_layer(torch.cat(blocks))
        return self.linear_2(self.act(self.linear_1(x)))
