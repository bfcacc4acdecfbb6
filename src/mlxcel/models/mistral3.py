"""Mistral 3 (Mistral Small 3.x with vision): the mistral text family under the Pixtral vision
tower and Mistral 3's projector (layers/vision_pixtral.py). Each image becomes rows of `[IMG]`
placeholders (one per m x m block of patches), each row closed by `[IMG_BREAK]`, the last by
`[IMG_END]`; the projector's rows replace the `[IMG]` tokens in order.

Checkpoint names: `language_model.model.*` / `language_model.lm_head` (renamed to the decoder's
`model.*` / `lm_head` on load), `vision_tower.*`, `multi_modal_projector.*`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mlxcel.layers.decoder import DecoderLM
from mlxcel.layers.vision_pixtral import Mistral3Projector, PixtralSpec, PixtralTower
from mlxcel.models import mistral
from mlxcel.models.qwen2_5_vl import text_config_of

TEXT_FAMILIES = ("mistral",)


@dataclass(frozen=True)
class ModelArgs(mistral.ModelArgs):
    vision_config: dict[str, Any] | None = None
    image_token_index: int = 10
    spatial_merge_size: int = 2
    projector_hidden_act: str = "gelu"
    multimodal_projector_bias: bool = False
    vision_feature_layer: int = -1

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        text_type = (config.get("text_config") or {}).get("model_type", "mistral")
        if text_type not in TEXT_FAMILIES:
            raise ValueError(f"mistral3 over a {text_type!r} text model is not supported (supported: {', '.join(TEXT_FAMILIES)})")
        if not isinstance(config.get("vision_feature_layer", -1), int):
            raise ValueError("mistral3: a list of vision_feature_layer is not supported")
        return super().prepare(text_config_of(config))

    @property
    def vision(self) -> PixtralSpec:
        return PixtralSpec.of(self.vision_config or {})

    @property
    def image_token_id(self) -> int:
        return self.image_token_index


class Model(DecoderLM):
    ARGS = ModelArgs

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        spec = args.vision
        self.vision_tower = PixtralTower(spec)
        self.multi_modal_projector = Mistral3Projector(
            spec.hidden_size, args.hidden_size, args.spatial_merge_size, args.rms_norm_eps,
            args.projector_hidden_act, args.multimodal_projector_bias)

    def encode_images(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each image [C, H, W] (H, W multiples of patch * merge) -> its rows [h * w / m^2, hidden]."""
        patches, grids = self.vision_tower(images, self.args.vision_feature_layer)
        rows = self.multi_modal_projector(patches, grids)
        return list(rows.split([h * w // self.args.spatial_merge_size**2 for h, w in grids]))

    @classmethod
    def sanitize(cls, weights: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
        return super().sanitize({_decoder_name(k): v for k, v in weights.items()}, args)


def _decoder_name(name: str) -> str:
    """`language_model.model.*` -> `model.*`, `language_model.lm_head.*` -> `lm_head.*` (transformers 5 in memory:
    `model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`)."""
    for old, new in (("language_model.", ""), ("model.language_model.", "model."), ("model.vision_tower.", "vision_tower."),
                     ("model.multi_modal_projector.", "multi_modal_projector.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name
