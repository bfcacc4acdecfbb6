"""Qwen3-VL: Qwen3's decoder with interleaved M-RoPE (height and width on every third frequency)
under the Qwen3-VL vision tower (layers/vision_qwen.py: whole-frame attention, learned positions,
deepstack mergers). The tower's deepstack outputs are added to the hidden states of the image
placeholders after each of the first decoder layers (one output per layer).

A video's frames each get their own M-RoPE grid (t = 1), as its timestamps separate them in the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from mlxcel.layers.attention import AttentionContext
from mlxcel.layers.decoder import EmbeddingOverride
from mlxcel.models import qwen3
from mlxcel.models.qwen2_5_vl import QwenVLFields, QwenVLModel


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
        values = embeds.values.to(self.model.embed_tokens.weight.dtype).split(hidden, dim=-1)
        x = EmbeddingOverride(embeds.rows, values[0]).apply(self.model.embed(input_ids))
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions, ctx)
            if i + 1 < len(values):
                x = x.index_add(0, embeds.rows.to(x.device), values[i + 1].to(x.device))
        return self.model.norm(x)

    def vision_positions(self, token_ids: list[int], grids: list[tuple[int, int, int]],
                         seconds_per_grid: list[float | None] | None = None) -> tuple[torch.Tensor, int]:
        frames = [(1, h, w) for t, h, w in grids for _ in range(t)]
        return super().vision_positions(token_ids, frames)
