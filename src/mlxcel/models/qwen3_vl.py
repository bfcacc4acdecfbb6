"""Qwen3-VL: Qwen3's decoder with interleaved M-RoPE (height and width on every third frequency)
under the Qwen3-VL vision tower (layers/vision_qwen.py: whole-frame attention, learned positions,
deepstack mergers). The tower's deepstack outputs are added to the hidden states of the image
placeholders after each of the first decoder layers (one output per layer); the engine hands them
in as the extra width of the placeholders' rows (`EmbeddingOverride.values` [n, hidden * (1 + deepstack)]).

A video's frames each get their own M-RoPE grid (t = 1), as its timestamps separate them in the prompt.
Images render and expand as Qwen2.5-VL's do (its `QwenImagePrompter`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from mlxcel.layers.attention import AttentionContext
from mlxcel.layers.decoder import EmbeddingOverride
from mlxcel.models import qwen3
from mlxcel.models._vision import ImageInput
from mlxcel.models.qwen2_5_vl import QwenVLFields, QwenVLModel

IS_VISION_LANGUAGE = True


@dataclass(frozen=True)
class ModelArgs(QwenVLFields, qwen3.ModelArgs):
    mrope_section: tuple[int, ...] = (24, 20, 20)
    mrope_interleaved: bool = True

    IS_V3: ClassVar[bool] = True


class Model(QwenVLModel):
    ARGS = ModelArgs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                embeds: EmbeddingOverride | None = None) -> torch.Tensor:
        """`embeds.values` [n, hidden * (1 + deepstack)]: the input rows, then each deepstack layer's addition."""
        hidden = self.args.hidden_size
        if embeds is None or embeds.values.shape[-1] == hidden:
            return super().forward(input_ids, positions, ctx, embeds)
        values = embeds.values.split(hidden, dim=-1)
        x = EmbeddingOverride(embeds.rows, values[0]).apply(self.model.embed(input_ids))
        rows = embeds.rows.to(x.device)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions, ctx)
            if i + 1 < len(values):
                x = x.index_add(0, rows, values[i + 1].to(device=x.device, dtype=x.dtype))
        return self.model.norm(x)

    def rope_positions(self, token_ids: Sequence[int], images: Sequence[ImageInput]) -> tuple[torch.Tensor, int]:
        frames = []
        for image in images:  # a video's frames: one grid each
            grid = image.pixels["image_grid_thw"].reshape(3)
            frames += [ImageInput(image.digest, image.runs, {"image_grid_thw": torch.tensor([1, *grid[1:].tolist()])})
                       ] * int(grid[0])
        return super().rope_positions(token_ids, frames)
