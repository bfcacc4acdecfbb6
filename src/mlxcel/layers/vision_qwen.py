"""The Qwen-VL vision towers (Qwen2.5-VL's and Qwen3-VL's): a ViT over patches of a dynamic-resolution
grid, with a 2-D rotary (height and width), and a patch merger that turns each m x m block of patches
into one language-model token. Qwen2.5-VL attends within windows of the image (full on a few blocks),
with RMSNorms and a gated MLP; Qwen3-VL attends over each whole frame, with LayerNorms, a plain MLP,
learned position embeddings resampled to the grid, and "deepstack" mergers whose outputs of a few
middle blocks are added to the language model's early hidden states.

Images arrive as transformers' Qwen2-VL image processor lays them out: `pixels` [num_patches,
channels * temporal_patch * patch * patch], the patches of each m x m merge block consecutive, and
`grid_thw` [num_images, 3] (temporal, height, width in patches). A video is an image with t > 1.

    patches -> patch_embed -> (reorder into windows) -> blocks (window or full attention,
    each over its own image only) -> merger -> (original order) -> [num_patches / m^2, out_dim]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mlxcel.layers.decoder import MLP, MLPRecipe
from mlxcel.layers.norm import LayerNorm, RMSNorm
from mlxcel.layers.patch_attention import axial_rope, segment_attention
from mlxcel.layers.rope import apply_rope


@dataclass(frozen=True)
class VisionSpec:
    """The tower's settings, as Qwen2.5-VL's `vision_config` names them."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    window_size: int = 112  # pixels; 0: every block attends over the whole image
    fullatt_block_indexes: tuple[int, ...] = ()
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    tokens_per_second: float = 4.0  # M-RoPE's temporal positions per second of video (Qwen2.5-VL)
    # Qwen3-VL's choices: LayerNorms, a plain MLP, a patch bias, learned positions, deepstack mergers
    is_v3: bool = False
    num_position_embeddings: int = 0
    deepstack_indexes: tuple[int, ...] = ()

    @staticmethod
    def of(config: dict[str, Any], *, is_v3: bool = False) -> VisionSpec:
        rope = config.get("rope_parameters") or {}
        return VisionSpec(
            int(config["depth"]), int(config["hidden_size"]), int(config["intermediate_size"]),
            int(config["num_heads"]), int(config["out_hidden_size"]), int(config.get("patch_size", 14)),
            int(config.get("temporal_patch_size", 2)), int(config.get("in_channels", 3)),
            int(config.get("spatial_merge_size", 2)), int(config.get("window_size", 0) or 0),
            tuple(config.get("fullatt_block_indexes") or ()), str(config.get("hidden_act", "silu")),
            float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            float(config.get("tokens_per_second", 4.0)), is_v3, int(config.get("num_position_embeddings", 0)),
            tuple(config.get("deepstack_visual_indexes") or ()) if is_v3 else ())

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    def tokens_of(self, grid_thw: tuple[int, int, int]) -> int:
        """Language-model tokens of one image or video: t * h * w / m^2."""
        t, h, w = grid_thw
        return t * h * w // self.merge_unit


# ---- index plans (no weights; computed once per batch of images) --------------------------------

@dataclass(frozen=True)
class PatchPlan:
    """Where each patch goes in a batch of images: its (h, w) rotary positions, the window order
    and the segment bounds of window and full attention (in the window order)."""

    positions: torch.Tensor  # [num_patches, 2] (row, column), in the processor's order
    window_order: torch.Tensor  # [num_patches / m^2] merged-token indices, window by window
    window_bounds: tuple[int, ...]  # cumulative patch counts of the windows (0 first)
    image_bounds: tuple[int, ...]  # cumulative patch counts of each frame of each image


def plan_patches(grid_thw: list[tuple[int, int, int]], spec: VisionSpec) -> PatchPlan:
    positions, order, window_bounds, image_bounds = [], [], [0], [0]
    num_merged = 0
    for t, h, w in grid_thw:
        positions.append(_patch_positions(h, w, spec.spatial_merge_size).repeat(t, 1))
        for _ in range(t):
            image_bounds.append(image_bounds[-1] + h * w)
        frame_order, frame_counts = _windows(t, h // spec.spatial_merge_size, w // spec.spatial_merge_size, spec)
        order.append(frame_order + num_merged)
        for count in frame_counts:
            window_bounds.append(window_bounds[-1] + count * spec.merge_unit)
        num_merged += t * (h // spec.spatial_merge_size) * (w // spec.spatial_merge_size)
    return PatchPlan(torch.cat(positions), torch.cat(order), tuple(window_bounds), tuple(image_bounds))


def _patch_positions(h: int, w: int, merge: int) -> torch.Tensor:
    """[h * w, 2] (row, column) of each patch, in merge-block order (each m x m block's patches together)."""
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    # [bh, m, bw, m] -> [bh, bw, m, m]: block-major, then within the block row-major
    return torch.stack((rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()), dim=-1)


def _windows(t: int, gh: int, gw: int, spec: VisionSpec) -> tuple[torch.Tensor, list[int]]:
    """Merged tokens of one image ([t, gh, gw] grid) window by window, row-major within a window;
    and each non-empty window's token count. A window is `window_size` pixels square."""
    size = spec.window_size // spec.spatial_merge_size // spec.patch_size if spec.window_size else max(gh, gw)
    index = torch.arange(t * gh * gw).view(t, gh, gw)
    num_h, num_w = -(-gh // size), -(-gw // size)
    padded = F.pad(index, (0, num_w * size - gw, 0, num_h * size - gh), value=-1)
    # [t, num_h, size, num_w, size] -> [t, num_h, num_w, size * size]
    windows = padded.view(t, num_h, size, num_w, size).permute(0, 1, 3, 2, 4).reshape(t * num_h * num_w, -1)
    counts = (windows >= 0).sum(-1)
    return windows[windows >= 0], [int(c) for c in counts if c > 0]


# ---- blocks -----------------------------------------------------------------------------------

class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], bounds: tuple[int, ...]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = rope
        # The rotation in float32, as the reference does it.
        q, k = (apply_rope(y.float(), cos, sin).to(x.dtype) for y in (q, k))
        out = segment_attention(q, k, v, bounds, self.head_dim**-0.5)
        return self.proj(out.reshape(n, -1))


def _norm(spec: VisionSpec, dim: int) -> nn.Module:
    return LayerNorm(dim, 1e-6) if spec.is_v3 else RMSNorm(dim, 1e-6)


def _mlp_recipe(spec: VisionSpec) -> MLPRecipe:
    if spec.is_v3:
        return MLPRecipe(spec.intermediate_size, spec.hidden_act, gated=False, bias=True,
                         names=("linear_fc1", "linear_fc2"))
    return MLPRecipe(spec.intermediate_size, spec.hidden_act, bias=True)


class VisionBlock(nn.Module):
    """Pre-norm ViT block: x += attn(norm1(x)); x += mlp(norm2(x))."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.norm1, self.norm2 = _norm(spec, spec.hidden_size), _norm(spec, spec.hidden_size)
        self.attn = VisionAttention(spec.hidden_size, spec.num_heads)
        self.mlp = MLP(spec.hidden_size, _mlp_recipe(spec))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], bounds: tuple[int, ...]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, bounds)
        return x + self.mlp(self.norm2(x), None)


class PatchMerger(nn.Module):
    """Each m x m block of patch states (consecutive rows) -> one token of the language model's width."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.width = spec.hidden_size * spec.merge_unit
        self.ln_q = _norm(spec, spec.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, spec.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class PatchMergerV3(nn.Module):
    """Qwen3-VL's merger: its LayerNorm over each patch (`after_shuffle`: over the m x m block, the
    deepstack mergers), then fc1, GELU, fc2."""

    def __init__(self, spec: VisionSpec, *, after_shuffle: bool = False) -> None:
        super().__init__()
        self.width, self.after_shuffle = spec.hidden_size * spec.merge_unit, after_shuffle
        self.norm = LayerNorm(self.width if after_shuffle else spec.hidden_size, 1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, spec.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.after_shuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d (kernel = stride = one patch) as the matmul it is over flat patches."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        kernel = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        self.proj = nn.Conv3d(spec.in_channels, spec.hidden_size, kernel, stride=kernel, bias=spec.is_v3)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.view(weight.shape[0], -1), self.proj.bias)


def resampled_positions(table: torch.Tensor, grid_thw: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """Qwen3-VL's learned positions: the square table [side^2, hidden] resampled bilinearly (corners
    aligned) to each image's h x w patches, in merge-block order, repeated per frame: [N, hidden]."""
    side = int(table.shape[0] ** 0.5)
    square = table.view(side, side, -1).permute(2, 0, 1).unsqueeze(0).float()  # [1, hidden, side, side]
    out = []
    for t, h, w in grid_thw:
        grid = F.interpolate(square, size=(h, w), mode="bilinear", align_corners=True)[0]  # [hidden, h, w]
        # [hidden, h/m, m, w/m, m] -> [h/m, w/m, m, m, hidden]
        blocks = grid.view(-1, h // merge, merge, w // merge, merge).permute(1, 3, 2, 4, 0).reshape(h * w, -1)
        out.append(blocks.repeat(t, 1))
    return torch.cat(out).to(table.dtype)


class QwenVisionTower(nn.Module):
    """Qwen2.5-VL's `visual`: pixels [num_patches, C*T*P*P] + grids -> tokens [num_patches / m^2, out]."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.patch_embed = PatchEmbed(spec)
        if spec.num_position_embeddings:
            self.pos_embed = nn.Embedding(spec.num_position_embeddings, spec.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(spec) for _ in range(spec.depth))
        self.merger = PatchMergerV3(spec) if spec.is_v3 else PatchMerger(spec)
        if spec.deepstack_indexes:
            self.deepstack_merger_list = nn.ModuleList(
                PatchMergerV3(spec, after_shuffle=True) for _ in spec.deepstack_indexes)

    def rope(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The 2-D rotary: rows and columns turn at the same head_dim / 4 frequencies."""
        quarter = self.spec.head_dim // 4
        freqs = 1.0 / (self.spec.rope_theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float) / (2 * quarter)))
        freqs = freqs.to(device)
        return axial_rope(positions, freqs, freqs)

    def forward(self, pixels: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """The merged tokens [N / m^2, out], then each deepstack merger's (Qwen3-VL), in the images' order."""
        spec, plan = self.spec, plan_patches(grid_thw, self.spec)
        x = self.patch_embed(pixels)
        if spec.num_position_embeddings:
            x = x + resampled_positions(self.pos_embed.weight, grid_thw, spec.spatial_merge_size).to(x.device)
        # Reorder whole merge blocks into window order (a permutation of [N / m^2] blocks).
        order = plan.window_order.to(x.device)
        x = x.view(-1, spec.merge_unit, x.shape[-1])[order].flatten(0, 1)
        cos, sin = self.rope(plan.positions, x.device)
        cos, sin = (t.view(-1, spec.merge_unit, *t.shape[1:])[order].flatten(0, 1) for t in (cos, sin))
        full = plan.image_bounds
        windowed = plan.window_bounds if spec.window_size else full
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, (cos, sin), full if i in spec.fullatt_block_indexes else windowed)
            if i in spec.deepstack_indexes:
                deepstack.append(self.deepstack_merger_list[spec.deepstack_indexes.index(i)](x))
        back = torch.argsort(order)
        return [merged[back] for merged in (self.merger(x), *deepstack)]


# ---- the language model's M-RoPE positions ---------------------------------------------------------

def mrope_positions(token_ids: list[int], grids: list[tuple[int, int, int]], placeholder_ids: tuple[int, ...],
                    merge: int, time_steps: list[float] | None = None) -> tuple[torch.Tensor, int]:
    """M-RoPE positions [3, len(token_ids)] and the offset of the positions after them.

    Text runs count on from the last position on all three rows. Each image or video (`grids` in
    the order their placeholder runs appear; a video's temporal rows step by `time_steps[i]`, its
    tokens per second times its seconds per temporal patch; 1 for an image) takes the current position plus its merged (t, row,
    column) on the three rows, and the text after it starts `max(h, w) / m` further on (transformers 5.25's rule).
    """
    placeholders = torch.isin(torch.tensor(token_ids, dtype=torch.int64), torch.tensor(placeholder_ids))
    rows, current, index = [], 0, 0
    for i, grid in enumerate(grids):
        start = index + int(placeholders[index:].int().argmax()) if placeholders[index:].any() else len(token_ids)
        count = grid[0] * grid[1] * grid[2] // merge**2
        if start + count > len(token_ids) or not bool(placeholders[start:start + count].all()):
            raise ValueError(f"the prompt has no run of {count} placeholder tokens for image {len(rows)}")
        rows.append(torch.arange(start - index).expand(3, -1) + current)
        current += start - index
        rows.append(_grid_positions(grid, merge, time_steps[i] if time_steps else 1.0) + current)
        current += max(grid[1], grid[2]) // merge
        index = start + count
    rows.append(torch.arange(len(token_ids) - index).expand(3, -1) + current)
    positions = torch.cat(rows, dim=1)
    return positions, int(positions.max()) + 1 - len(token_ids) if len(token_ids) else 0


def _grid_positions(grid: tuple[int, int, int], merge: int, interval: float) -> torch.Tensor:
    """[3, t * h/m * w/m]: (temporal, row, column) of each merged token, row-major per frame."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    temporal = (torch.arange(t) * interval).long()  # as the reference rounds: toward zero
    tt, hh, ww = torch.meshgrid(temporal, torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack((tt, hh, ww)).reshape(3, -1)
