"""Qwen2.5-VL: Qwen2's decoder with M-RoPE (three rotary sections turned by temporal, height and
width positions) under the Qwen-VL vision tower (layers/vision_qwen.py: windowed ViT, 2-D rope,
patch merger), whose tokens replace the prompt's image / video placeholder tokens.

Checkpoint names as the Hub has them: `model.*` (the text decoder), `visual.*`, `lm_head`;
transformers 5's in-memory `model.language_model.*` / `model.visual.*` are renamed on load.
`QwenVLFields` and `QwenVLModel` are what qwen3_vl shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from mlxcel.layers.decoder import DecoderLM, RopeRecipe
from mlxcel.layers.vision_qwen import QwenVisionTower, VisionSpec, mrope_positions
from mlxcel.models import qwen2


@dataclass(frozen=True)
class QwenVLFields:
    """The vision-language part of a Qwen-VL config, mixed into a text family's ModelArgs."""

    vision_config: dict[str, Any] | None = None
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    mrope_section: tuple[int, ...] = (16, 24, 24)
    mrope_interleaved: bool = False

    IS_V3: ClassVar[bool] = False

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        config = text_config_of(config)
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        section = tuple(rope.get("mrope_section") or cls.mrope_section)
        interleaved = bool(rope.get("mrope_interleaved", cls.mrope_interleaved))
        config = super().prepare(config)  # type: ignore[misc]
        return {**config, "mrope_section": section, "mrope_interleaved": interleaved}

    @property
    def vision(self) -> VisionSpec:
        return VisionSpec.of(self.vision_config or {}, is_v3=self.IS_V3)

    def layer_rope(self, layer_idx: int) -> RopeRecipe:
        scaling = {**(self.rope_scaling or {}), "rope_type": "mrope", "mrope_section": list(self.mrope_section),
                   "mrope_interleaved": self.mrope_interleaved}
        return RopeRecipe.of(self.rope_theta, scaling, self.dim_per_head)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class ModelArgs(QwenVLFields, qwen2.ModelArgs):
    pass


def text_config_of(config: dict[str, Any]) -> dict[str, Any]:
    """A VLM's config with its `text_config` raised to the top (the decoder's fields), the rest kept."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config
    outer = {k: v for k, v in config.items() if k != "text_config"}
    return {**text, **{k: v for k, v in outer.items() if k not in text or k == "model_type"}}


class QwenVLModel(DecoderLM):
    """A Qwen-VL model: the text decoder with the vision tower `visual` beside it."""

    def __init__(self, args: Any) -> None:
        super().__init__(args)
        self.visual = QwenVisionTower(args.vision)

    def encode_vision(self, pixels: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Each image's or video's (one grid each) rows [n_i, width] for its placeholders: the input
        embedding, then (Qwen3-VL) each deepstack layer's addition, side by side."""
        outputs = self.visual(pixels, grid_thw)
        rows = torch.cat(outputs, dim=-1) if len(outputs) > 1 else outputs[0]
        return list(rows.split([self.args.vision.tokens_of(g) for g in grid_thw]))

    def vision_positions(self, token_ids: list[int], grids: list[tuple[int, int, int]],
                         seconds_per_grid: list[float | None] | None = None) -> tuple[torch.Tensor, int]:
        """M-RoPE positions [3, len] of a prompt whose placeholders hold `grids` in order, and the
        offset of every later position (the next token's position is its index plus the offset).
        `seconds_per_grid`: a video's seconds per temporal patch (None for an image)."""
        vision = self.args.vision
        steps = [vision.tokens_per_second * s if s is not None else 1.0 for s in seconds_per_grid or [None] * len(grids)]
        return mrope_positions(token_ids, grids, (self.args.image_token_id, self.args.video_token_id),
                               vision.spatial_merge_size, steps)

    @classmethod
    def sanitize(cls, weights: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        return super().sanitize({_hub_name(k): v for k, v in weights.items()}, args)


def _hub_name(name: str) -> str:
    """transformers 5's in-memory names -> the Hub's (`model.language_model.` -> `model.`, `model.visual.` -> `visual.`)."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("model.visual."):
        return name[len("model."):]
    return name


class Model(QwenVLModel):
    ARGS = ModelArgs
