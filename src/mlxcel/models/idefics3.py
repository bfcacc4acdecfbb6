"""Idefics3 / SmolVLM (issue 43, models/_vision.py): a Llama text model, a SigLIP tower
(`vision_model.`) and the connector: pixel shuffle (scale_factor x scale_factor patches folded into
the channels) and one linear into the text width (`connector.modality_projection.proj`).

An image is split into tiles of max_image_size plus a downscaled global image (transformers'
Idefics3 image processor, with the checkpoint's settings); each tile becomes image_seq_len `<image>`
tokens. The marker `<image>` expands as Idefics3Processor writes it: per tile
`<fake_token_around_image><row_R_col_C>` and its tokens, a newline after each row, then
`\\n<fake_token_around_image><global-img>`, the global image's tokens and `<fake_token_around_image>`.
The placeholders attend causally.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mlxcel.layers.decoder import DecoderArgs
from mlxcel.layers.vision import VisionRecipe, VisionTransformer, pixel_shuffle
from mlxcel.models import _mmproj, llama
from mlxcel.models._vision import (
    ImageInput, PromptTokenizer, config_token, decode_image, expand_markers, image_digest, load_image_processor,
    VisionFamily, pixel_batch, placeholder_runs, single_token,
)

IS_VISION_LANGUAGE = True


@dataclass(frozen=True)
class ModelArgs(llama.ModelArgs):
    pass


class ModalityProjection(nn.Module):
    def __init__(self, width: int, text_hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, text_hidden, bias=False)


class Connector(nn.Module):
    def __init__(self, vision: dict[str, Any], text_hidden: int) -> None:
        super().__init__()
        self.scale_factor = int(vision.get("scale_factor", 2))
        width = int(vision["vision_config"]["hidden_size"]) * self.scale_factor**2
        self.modality_projection = ModalityProjection(width, text_hidden)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(pixel_shuffle(features, self.scale_factor))


class ImagePrompter:
    """Idefics3's processor side: transformers' Idefics3 image processor (tiles and the global image)
    and Idefics3Processor's prompt expansion."""

    def __init__(self, vision: dict[str, Any], model_dir: Path | None, tokenizer: PromptTokenizer) -> None:
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

        config = vision["vision_config"]
        size, patch = int(config["image_size"]), int(config["patch_size"])
        defaults = {"size": {"longest_edge": 4 * size}, "max_image_size": {"longest_edge": size},
                    **vision.get("image_processor", {})}  # an mmproj file's settings (attach_mmproj)
        self.processor = load_image_processor(model_dir, Idefics3ImageProcessorPil, **defaults)
        self.image_token = config_token(vision, "image_token_id", "image_token_index")
        self.image_seq_len = (size // patch) ** 2 // int(vision.get("scale_factor", 2)) ** 2
        self.tokenizer = tokenizer
        self.marker = tokenizer.decode([self.image_token], skip_special_tokens=False)

    def prepare(self, token_ids: list[int], images: Sequence[bytes]) -> tuple[list[int], tuple[ImageInput, ...]]:
        expansions, pixels = [], []
        for data in images:
            features = self.processor(images=[[decode_image(data)]], return_tensors="pt", return_row_col_info=True)
            rows, cols = int(features["rows"][0][0]), int(features["cols"][0][0])
            text = image_prompt_string(rows, cols, self.image_seq_len, self.marker)
            expansions.append(self.tokenizer.encode(text, add_special_tokens=False))
            pixels.append(features["pixel_values"][0])  # [tiles, 3, H, W]
        expanded = expand_markers(token_ids, self.image_token, expansions)
        runs = iter(placeholder_runs(expanded, self.image_token))
        inputs = tuple(ImageInput(image_digest(data), tuple(next(runs) for _ in range(len(tiles))),
                                  {"pixel_values": tiles})
                       for data, tiles in zip(images, pixels))
        return expanded, inputs


_TEXT_PREFIXES = {"model.text_model.": "model."}
_VISION_PREFIXES = {"model.vision_model.": "vision_model.", "model.connector.": "connector."}


class Model(VisionFamily, llama.Model):
    ARGS = ModelArgs
    PROMPTER = ImagePrompter
    TEXT_PREFIXES, VISION_PREFIXES = _TEXT_PREFIXES, _VISION_PREFIXES

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__(args)
        self.vision = args.extra.get("vision")
        if self.vision is not None:
            self.vision_model = VisionTransformer(VisionRecipe.from_config(self.vision["vision_config"]))
            self.connector = Connector(self.vision, args.hidden_size)

    def encode_images(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Every tile of every image in one batch: [tiles x image_seq_len, hidden] per image."""
        features = self.connector(self.vision_model(pixel_batch(images, self.connector.modality_projection.proj.weight)))
        return [part.flatten(0, 1) for part in features.split([len(image.pixels["pixel_values"]) for image in images])]


def image_prompt_string(rows: int, cols: int, seq_len: int, image_token: str) -> str:
    """Idefics3Processor's text for one image of rows x cols tiles (0 x 0: the global image alone)."""
    fake, tokens = "<fake_token_around_image>", image_token * seq_len
    tiles = "".join("".join(f"{fake}<row_{r + 1}_col_{c + 1}>{tokens}" for c in range(cols)) + "\n"
                    for r in range(rows))
    return f"{tiles}{chr(10) if rows or cols else ''}{fake}<global-img>{tokens}{fake}"


# ---- llama.cpp's projector file (--mmproj, loading/mmproj.py) ----

MMPROJ_TEXT_MODELS = (llama.Model,)  # SmolVLM's text GGUF is a plain llama one


def attach_mmproj(model: llama.Model, mmproj: Any, tokenizer: PromptTokenizer) -> None:
    """The SigLIP tower and connector from llama.cpp's idefics3 mmproj GGUF (SmolVLM; `mm.model.fc` the
    connector's linear, `clip.vision.projector.scale_factor` its pixel shuffle, `clip.vision.image_size` the
    tile, `clip.vision.preproc_image_size` the resized image's longest edge), attached to a llama text model
    loaded from GGUF, which becomes this family's Model (the same text weights)."""
    config = _mmproj.vision_config(mmproj, default_eps=1e-5)
    tile = config["image_size"]
    vision = {"vision_config": config, "scale_factor": int(_mmproj.clip_value(mmproj, "projector.scale_factor", 2)),
              "image_token_id": single_token(tokenizer, "<image>", "idefics3"),
              "image_processor": {
                  "size": {"longest_edge": int(_mmproj.clip_value(mmproj, "preproc_image_size", 4 * tile))},
                  "max_image_size": {"longest_edge": tile},
                  "image_mean": list(_mmproj.clip_value(mmproj, "image_mean", [0.5] * 3)),
                  "image_std": list(_mmproj.clip_value(mmproj, "image_std", [0.5] * 3))}}
    param = next(model.model.norm.parameters())
    connector = Connector(vision, model.args.hidden_size)
    connector.modality_projection.proj.weight.data.copy_(_mmproj.tensor(mmproj, "mm.model.fc.weight"))
    model.__class__ = Model  # NOTE: only adds the vision side: Model's text part is llama.Model's
    model.vision_model = _mmproj.load_tower(mmproj, config, param)
    model.connector = connector.to(param.device, param.dtype).eval()
    model.vision = vision
