"""Vision blocks every vision-language family is assembled from (issue 43; DESIGN rule 2).

`VisionTransformer` is the ViT of SigLIP (Gemma 3, SmolVLM / Idefics3), CLIP (LLaVA) and their kin:
patch embedding (a strided convolution), learned position embeddings, pre-norm encoder layers
with full (non-causal) attention and a two-layer MLP, then an optional final LayerNorm. The
choices that tell those towers apart are `VisionRecipe` fields: CLIP's class token and pre-norm
(`pre_layrnorm`, the checkpoint's spelling), the final norm, the patch bias and the activation.
Parameter names are the checkpoint's (`embeddings.patch_embedding`, `encoder.layers.N.self_attn.q_proj`,
`post_layernorm`, ...), so a tower's state dict loads as saved.

`pool_patches` and `pixel_shuffle` are the two ways projectors shrink the patch grid: Gemma 3
averages k x k patches; Idefics3 folds r x r neighbours into the channels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mlxcel.layers.decoder import activation
from mlxcel.layers.norm import LayerNorm


@dataclass(frozen=True)
class VisionRecipe:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    image_size: int
    num_channels: int = 3
    activation: str = "gelu_pytorch_tanh"
    eps: float = 1e-6
    class_token: bool = False  # CLIP: a learned class embedding before the patches
    pre_norm: bool = False  # CLIP's `pre_layrnorm` after the embeddings
    post_norm: bool = True  # SigLIP's `post_layernorm`
    patch_bias: bool = True

    @staticmethod
    def from_config(config: dict[str, Any], **choices: Any) -> VisionRecipe:
        """The recipe from an HF vision_config (SigLIP / CLIP / Idefics3 field names)."""
        return VisionRecipe(
            int(config["hidden_size"]), int(config["num_hidden_layers"]), int(config["num_attention_heads"]),
            int(config["intermediate_size"]), int(config["patch_size"]), int(config["image_size"]),
            int(config.get("num_channels", 3)), config.get("hidden_act", "gelu_pytorch_tanh"),
            float(config.get("layer_norm_eps", 1e-6)), **choices)

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class VisionEmbeddings(nn.Module):
    def __init__(self, r: VisionRecipe) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(r.num_channels, r.hidden_size, r.patch_size, r.patch_size, bias=r.patch_bias)
        num_positions = r.patches_per_side**2 + int(r.class_token)
        self.position_embedding = nn.Embedding(num_positions, r.hidden_size)
        if r.class_token:
            self.class_embedding = nn.Parameter(torch.zeros(r.hidden_size))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [B, C, H, W] -> [B, patches (+1), hidden]."""
        weight = self.patch_embedding.weight
        x = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        if hasattr(self, "class_embedding"):
            x = torch.cat((self.class_embedding.expand(x.shape[0], 1, -1), x), dim=1)
        return x + self.position_embedding.weight[:x.shape[1]]


class VisionAttention(nn.Module):
    def __init__(self, r: VisionRecipe) -> None:
        super().__init__()
        self.num_heads, self.head_dim = r.num_heads, r.hidden_size // r.num_heads
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self, name, nn.Linear(r.hidden_size, r.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        # [B, heads, patches, head_dim]
        q, k, v = (p(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class VisionMLP(nn.Module):
    def __init__(self, r: VisionRecipe) -> None:
        super().__init__()
        self.act = activation(r.activation)
        self.fc1 = nn.Linear(r.hidden_size, r.intermediate_size)
        self.fc2 = nn.Linear(r.intermediate_size, r.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, r: VisionRecipe) -> None:
        super().__init__()
        self.layer_norm1 = LayerNorm(r.hidden_size, eps=r.eps)
        self.self_attn = VisionAttention(r)
        self.layer_norm2 = LayerNorm(r.hidden_size, eps=r.eps)
        self.mlp = VisionMLP(r)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, r: VisionRecipe) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(r) for _ in range(r.num_layers))


class VisionTransformer(nn.Module):
    """The tower (the checkpoint's `vision_model.` part): pixels -> patch features."""

    def __init__(self, recipe: VisionRecipe) -> None:
        super().__init__()
        self.recipe = recipe
        self.embeddings = VisionEmbeddings(recipe)
        if recipe.pre_norm:
            self.pre_layrnorm = LayerNorm(recipe.hidden_size, eps=recipe.eps)
        self.encoder = VisionEncoder(recipe)
        if recipe.post_norm:
            self.post_layernorm = LayerNorm(recipe.hidden_size, eps=recipe.eps)

    def forward(self, pixel_values: torch.Tensor, feature_layer: int | None = None) -> torch.Tensor:
        """pixel_values [B, C, H, W] -> [B, tokens, hidden]: the last layer's output through the final
        norm, or (`feature_layer`, LLaVA's vision_feature_layer) that hidden state, HF-indexed: 0 is the
        embeddings, -1 the last layer's output (no final norm)."""
        x = self.embeddings(pixel_values)
        if self.recipe.pre_norm:
            x = self.pre_layrnorm(x)
        num_layers = len(self.encoder.layers)
        stop = num_layers if feature_layer is None else feature_layer % (num_layers + 1)
        for layer in self.encoder.layers[:stop]:
            x = layer(x)
        if feature_layer is None and self.recipe.post_norm:
            x = self.post_layernorm(x)
        return x


def pool_patches(features: torch.Tensor, patches_per_side: int, kernel: int) -> torch.Tensor:
    """[B, side * side, hidden] -> [B, (side / kernel)^2, hidden]: k x k average pooling (Gemma 3)."""
    b, _, hidden = features.shape
    grid = features.transpose(1, 2).reshape(b, hidden, patches_per_side, patches_per_side)
    return F.avg_pool2d(grid, kernel, kernel).flatten(2).transpose(1, 2)


def pixel_shuffle(features: torch.Tensor, factor: int) -> torch.Tensor:
    """[B, side * side, hidden] -> [B, side^2 / factor^2, hidden * factor^2]: each factor x factor
    neighbourhood folded into the channels, in Idefics3's order."""
    b, n, hidden = features.shape
    side = int(n**0.5)
    x = features.view(b, side, side // factor, hidden * factor)
    x = x.permute(0, 2, 1, 3).reshape(b, side // factor, side // factor, hidden * factor * factor)
    return x.permute(0, 2, 1, 3).reshape(b, n // factor**2, hidden * factor**2)
