"""LLaVA-NeXT (issue 43, models/_vision.py): LLaVA's tower and projector (models/llava.py) over any text
family of ours, with "anyres" tiling. The image processor picks the best of `image_grid_pinpoints` for the
image's size and cuts the resized image into tiles of the tower's size, after one base tile of the whole
image. Every tile goes through the tower and projector; the tiles' features are laid out as one grid, the
letterbox padding is cut off again (unpadding, to the image's aspect ratio), and each row of the grid ends
with the learned `image_newline` row; the base tile's features come first (transformers 5.25's
`pack_image_features` with the "spatial_unpad" merge, the only one it has). Each `<image>` marker becomes
that many placeholders (LlavaNextProcessor's count).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from mlxcel.layers.decoder import DecoderArgs
from mlxcel.models import llava
from mlxcel.models._vision import (
    ImageInput, PromptTokenizer, config_token, decode_image, expand_markers, image_digest, placeholder_runs,
    split_runs,
)

IS_VISION_LANGUAGE = True
ModelArgs = llava.ModelArgs


def unpadded_box(height: int, width: int, original: tuple[int, int]) -> tuple[int, int, int, int]:
    """(top, rows, left, columns) of a [height, width] feature grid that the image of `original` (height,
    width) fills once its letterbox padding is cut off (transformers' unpad_image and the processor's count)."""
    original_height, original_width = original
    if original_width / original_height > width / height:
        new_height = int(round(original_height * (width / original_width), 7))
        padding = (height - new_height) // 2
        return padding, height - 2 * padding, 0, width
    new_width = int(round(original_width * (height / original_height), 7))
    padding = (width - new_width) // 2
    return 0, height, padding, width - 2 * padding


class ImagePrompter:
    """LLaVA-NeXT's processor side: the checkpoint's anyres image processor; `<image>` -> the image's
    base tile, unpadded grid and row newlines, one placeholder each."""

    def __init__(self, vision: dict[str, Any], model_dir: Path | None, tokenizer: PromptTokenizer) -> None:
        from transformers import AutoImageProcessor
        from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

        config = vision["vision_config"]
        self.tile, self.side = int(config["image_size"]), int(config["image_size"]) // int(config["patch_size"])
        self.pinpoints = [list(map(int, p)) for p in vision.get("image_grid_pinpoints") or []]
        if not self.pinpoints:
            raise ValueError("llava_next: the config has no image_grid_pinpoints")
        if vision.get("vision_feature_select_strategy", "default") != "default":
            raise ValueError("llava_next: only vision_feature_select_strategy 'default' tiles (transformers' rule)")
        if model_dir is not None and (model_dir / "preprocessor_config.json").is_file():
            self.processor = AutoImageProcessor.from_pretrained(str(model_dir))
        else:
            self.processor = LlavaNextImageProcessorPil(
                size={"shortest_edge": self.tile}, crop_size={"height": self.tile, "width": self.tile},
                image_grid_pinpoints=self.pinpoints)
        self.image_token = config_token(vision, "image_token_index", "image_token_id")
        self.marker = tokenizer.decode([self.image_token], skip_special_tokens=False)

    def grid(self, original: tuple[int, int]) -> tuple[int, int]:
        """(rows, columns) of tiles for an image of `original` (height, width): the config's best pinpoint."""
        from transformers.image_processing_utils import select_best_resolution

        height, width = select_best_resolution(list(original), self.pinpoints)
        return height // self.tile, width // self.tile

    def num_tokens(self, original: tuple[int, int]) -> int:
        rows, columns = self.grid(original)
        _, height, _, width = unpadded_box(rows * self.side, columns * self.side, original)
        return self.side * self.side + height * (width + 1)

    def prepare(self, token_ids: list[int], images: Sequence[bytes]) -> tuple[list[int], tuple[ImageInput, ...]]:
        out = self.processor(images=[decode_image(data) for data in images], return_tensors="pt")
        sizes = [(int(h), int(w)) for h, w in out["image_sizes"].tolist()]
        lengths = [self.num_tokens(size) for size in sizes]
        expanded = expand_markers(token_ids, self.image_token, [[self.image_token] * n for n in lengths])
        runs = split_runs(placeholder_runs(expanded, self.image_token), lengths)
        inputs = []
        for i, (data, size, run) in enumerate(zip(images, sizes, runs)):
            rows, columns = self.grid(size)
            pixels = {"pixel_values": out["pixel_values"][i, :rows * columns + 1],  # [tiles, 3, H, W], unpadded batch
                      "image_sizes": torch.tensor(size), "grid": torch.tensor([rows, columns])}
            inputs.append(ImageInput(image_digest(data), (run,), pixels))
        return expanded, tuple(inputs)


class LlavaNextVision(llava.LlavaVision):
    """LLaVA's vision side plus the anyres layout and `image_newline`."""

    PROMPTER = ImagePrompter
    VISION_PREFIXES = {**llava.LLAVA_VISION_PREFIXES, "model.image_newline": "image_newline",
                       "image_newline": "image_newline"}

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__(args)
        if self.vision is not None:
            if not isinstance(self.vision.get("vision_feature_layer", -2), int):
                raise ValueError("llava_next: a list of vision_feature_layer values is not supported")
            self.image_newline = nn.Parameter(torch.zeros(args.hidden_size))

    def encode_images(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        tiles = [image.pixels["pixel_values"] for image in images]
        features = super().encode_images([ImageInput("", (), {"pixel_values": t}) for t in tiles])  # per tile
        counts = [len(t) for t in tiles]
        per_image = torch.stack(features).split(counts)  # each [tiles, side * side, hidden]
        return [self._pack(f, image) for f, image in zip(per_image, images)]

    def _pack(self, features: torch.Tensor, image: ImageInput) -> torch.Tensor:
        """[1 + rows * cols, side * side, hidden] -> [tokens, hidden]: the base tile, then the unpadded grid
        row by row, each row closed by image_newline."""
        rows, columns = (int(v) for v in image.pixels["grid"].tolist())
        side = int(round(features.shape[1] ** 0.5))
        hidden = features.shape[-1]
        # [rows, side, cols, side, hidden] -> [rows * side, cols * side, hidden]
        grid = features[1:].view(rows, columns, side, side, hidden).permute(0, 2, 1, 3, 4)
        grid = grid.reshape(rows * side, columns * side, hidden)
        size = tuple(int(v) for v in image.pixels["image_sizes"].tolist())
        top, height, left, width = unpadded_box(rows * side, columns * side, size)  # type: ignore[arg-type]
        grid = grid[top:top + height, left:left + width]
        newline = self.image_newline.to(grid.dtype).expand(height, 1, hidden)
        return torch.cat([features[0], torch.cat([grid, newline], dim=1).reshape(-1, hidden)])


@functools.cache
def _model_class(text: ModuleType) -> type[nn.Module]:
    return type(f"LlavaNext{text.Model.__name__}", (LlavaNextVision, text.Model), {"ARGS": text.ModelArgs})


class Model(nn.Module):
    """Builds the text family's Model with LLaVA-NeXT's vision side (`LlavaNextVision` mixed in)."""

    def __new__(cls, args: DecoderArgs) -> nn.Module:  # type: ignore[misc]
        return _model_class(llava._text_module(args.extra))(args)

    @classmethod
    def sanitize(cls, weights: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        return _model_class(llava._text_module(args.extra)).sanitize(weights, args)


__all__ = ["Model", "ModelArgs", "ImagePrompter", "unpadded_box"]
