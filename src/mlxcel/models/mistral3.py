"""Mistral 3 (Mistral Small 3.x with vision): the mistral text family under the Pixtral vision
tower and Mistral 3's projector (layers/vision_pixtral.py). Each image becomes rows of `[IMG]`
placeholders (one per m x m block of patches), each row closed by `[IMG_BREAK]`, the last by
`[IMG_END]`; the projector's rows replace the `[IMG]` tokens in order.

Checkpoint names: `language_model.model.*` / `language_model.lm_head` (renamed to the decoder's
`model.*` / `lm_head` on load by `VisionFamily`'s tables), `vision_tower.*`, `multi_modal_projector.*`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from mlxcel.layers.decoder import DecoderLM
from mlxcel.layers.vision_pixtral import Mistral3Projector, PixtralSpec, PixtralTower
from mlxcel.models import mistral
from mlxcel.models._vision import (
    ImageInput, PromptTokenizer, VisionFamily, decode_image, expand_markers, image_digest, load_image_processor,
    placeholder_runs, single_token,
)

IS_VISION_LANGUAGE = True
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
        text_type = config.get("text_model_type", "mistral")
        if text_type not in TEXT_FAMILIES:
            raise ValueError(f"mistral3 over a {text_type!r} text model is not supported (supported: {', '.join(TEXT_FAMILIES)})")
        outer = config.get("vision") or {}
        if not isinstance(outer.get("vision_feature_layer", -1), int):
            raise ValueError("mistral3: a list of vision_feature_layer is not supported")
        known = {k: outer[k] for k in ("vision_config", "image_token_index", "spatial_merge_size", "projector_hidden_act",
                                       "multimodal_projector_bias", "vision_feature_layer") if outer.get(k) is not None}
        return super().prepare({**config, **known})

    @property
    def vision_spec(self) -> PixtralSpec:
        return PixtralSpec.of(self.vision_config or {})


class Model(VisionFamily, DecoderLM):
    ARGS = ModelArgs
    TEXT_PREFIXES: ClassVar[Mapping[str, str]] = {
        "language_model.model.": "model.", "language_model.lm_head.": "lm_head.", "model.language_model.": "model."}
    VISION_PREFIXES: ClassVar[Mapping[str, str]] = {
        "model.vision_tower.": "vision_tower.", "vision_tower.": "vision_tower.",
        "model.multi_modal_projector.": "multi_modal_projector.", "multi_modal_projector.": "multi_modal_projector."}

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.vision = args.extra.get("vision")
        if self.vision is None or args.vision_config is None:
            raise ValueError("mistral3: the config has no vision_config")
        spec = args.vision_spec
        self.vision_tower = PixtralTower(spec)
        self.multi_modal_projector = Mistral3Projector(
            spec.hidden_size, args.hidden_size, args.spatial_merge_size, args.rms_norm_eps,
            args.projector_hidden_act, args.multimodal_projector_bias)

    def encode_images(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each image's rows [h * w / m^2, hidden] for its `[IMG]` placeholders, row by row."""
        weight = self.vision_tower.patch_conv.weight
        pixels = [image.pixels["pixel_values"].to(weight.device, weight.dtype) for image in images]
        return self.encode_pixels(pixels)

    def encode_pixels(self, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each image [C, H, W] (H, W multiples of patch * merge) -> its rows [h * w / m^2, hidden]."""
        patches, grids = self.vision_tower(pixels, self.args.vision_feature_layer)
        rows = self.multi_modal_projector(patches, grids)
        return list(rows.split([h * w // self.args.spatial_merge_size**2 for h, w in grids]))

    def image_prompter(self, model_dir: Path | None, tokenizer: PromptTokenizer) -> PixtralImagePrompter:
        return PixtralImagePrompter(self.args, model_dir, tokenizer)


class PixtralImagePrompter:
    """The processor side (models/_vision.py): transformers' Pixtral image processor with the
    checkpoint's settings (the longest edge bounded, both sides multiples of patch * merge); each
    `[IMG]` of the prompt becomes the image's rows of `[IMG]`, each row closed by `[IMG_BREAK]`,
    the last by `[IMG_END]` (PixtralProcessor's expansion)."""

    def __init__(self, args: ModelArgs, model_dir: Path | None, tokenizer: PromptTokenizer) -> None:
        from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

        spec = args.vision_spec
        self.step = spec.patch_size * args.spatial_merge_size  # pixels a placeholder covers on each side
        image_size = int((args.vision_config or {}).get("image_size", 1024))
        self.processor = load_image_processor(model_dir, PixtralImageProcessorPil, size={"longest_edge": image_size},
                                              patch_size=spec.patch_size)
        self.image = args.image_token_index
        self.image_break, self.image_end = (single_token(tokenizer, name, "mistral3") for name in ("[IMG_BREAK]", "[IMG_END]"))
        self.marker = tokenizer.decode([self.image], skip_special_tokens=False)

    def prepare(self, token_ids: list[int], images: Sequence[bytes]) -> tuple[list[int], tuple[ImageInput, ...]]:
        if not images:
            return token_ids, ()
        processed = self.processor(images=[decode_image(data) for data in images], patch_size=self.step,
                                   return_tensors="pt")
        sizes = [(int(h), int(w)) for h, w in processed["image_sizes"]]
        expansions = [self._tokens(h // self.step, w // self.step) for h, w in sizes]
        expanded = expand_markers(token_ids, self.image, expansions)
        runs = iter(placeholder_runs(expanded, self.image))
        return expanded, tuple(
            ImageInput(image_digest(data), tuple(next(runs) for _ in range(h // self.step)),
                       {"pixel_values": processed["pixel_values"][i, :, :h, :w]})
            for i, (data, (h, w)) in enumerate(zip(images, sizes)))

    def _tokens(self, rows: int, cols: int) -> list[int]:
        tokens: list[int] = []
        for _ in range(rows):
            tokens += [self.image] * cols + [self.image_break]
        tokens[-1] = self.image_end
        return tokens

