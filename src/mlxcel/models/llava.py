"""LLaVA (issue 43, models/_vision.py): a CLIP (or SigLIP) vision tower and a two-layer projector
(`multi_modal_projector.linear_1`, activation, `linear_2`) over any text family of ours: the text
side is the family `text_config.model_type` names, built as that family builds it.

The tower's features are the hidden state at `vision_feature_layer` (-2: the next-to-last layer's
output, no final norm), without the class token under the "default" select strategy. Each `<image>`
marker becomes (image_size / patch_size)^2 placeholders (LlavaProcessor's count); the image is
resized and centre-cropped by the checkpoint's image processor (CLIP's, through transformers'
AutoImageProcessor when the folder has preprocessor_config.json).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from mlxcel.layers.decoder import DecoderArgs, DecoderLM, activation
from mlxcel.layers.vision import VisionRecipe, VisionTransformer
from mlxcel.models._vision import (
    ImageInput, PromptTokenizer, VisionFamily, config_token, decode_image, expand_markers, image_digest, pixel_batch,
    LLAVA_TEXT_PREFIXES, LLAVA_VISION_PREFIXES, placeholder_runs, single_token, split_runs,
)

IS_VISION_LANGUAGE = True


def _text_module(config: dict[str, Any]) -> ModuleType:
    text_type = config.get("text_model_type") or "llama"
    if not str(text_type).isidentifier() or text_type in ("llava", "llava_next"):
        raise ValueError(f"llava: text model_type {text_type!r} is not supported")
    return importlib.import_module(f"mlxcel.models.{text_type}")


class ModelArgs:
    """The text family's own arguments (its config reader); the vision config rides in `extra["vision"]`."""

    @staticmethod
    def from_dict(config: dict[str, Any]) -> DecoderArgs:
        return _text_module(config).ModelArgs.from_dict(config)


class Projector(nn.Module):
    def __init__(self, vision: dict[str, Any], text_hidden: int) -> None:
        super().__init__()
        bias = bool(vision.get("multimodal_projector_bias", True))
        self.linear_1 = nn.Linear(int(vision["vision_config"]["hidden_size"]), text_hidden, bias=bias)
        self.act = activation(vision.get("projector_hidden_act", "gelu"))
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class ImagePrompter:
    """LLaVA's processor side: the checkpoint's image processor; `<image>` -> one placeholder a patch."""

    def __init__(self, vision: dict[str, Any], model_dir: Path | None, tokenizer: PromptTokenizer) -> None:
        from transformers import AutoImageProcessor, CLIPImageProcessor

        config = vision["vision_config"]
        size, patch = int(config["image_size"]), int(config["patch_size"])
        if model_dir is not None and (model_dir / "preprocessor_config.json").is_file():
            self.processor = AutoImageProcessor.from_pretrained(str(model_dir))
        else:  # the tower's size, and an mmproj file's normalisation (attach_mmproj)
            self.processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                                                **vision.get("image_processor", {}))
        self.image_token = config_token(vision, "image_token_index", "image_token_id")
        is_full = vision.get("vision_feature_select_strategy", "default") == "full"
        self.num_tokens = (size // patch) ** 2 + int(is_full)
        self.marker = tokenizer.decode([self.image_token], skip_special_tokens=False)

    def prepare(self, token_ids: list[int], images: Sequence[bytes]) -> tuple[list[int], tuple[ImageInput, ...]]:
        expanded = expand_markers(token_ids, self.image_token, [[self.image_token] * self.num_tokens] * len(images))
        pixels = self.processor(images=[decode_image(data) for data in images], return_tensors="pt")["pixel_values"]
        runs = split_runs(placeholder_runs(expanded, self.image_token), [self.num_tokens] * len(images))
        return expanded, tuple(ImageInput(image_digest(data), (run,), {"pixel_values": pixels[i:i + 1]})
                               for i, (data, run) in enumerate(zip(images, runs)))


class LlavaVision(VisionFamily, nn.Module):
    """What LLaVA adds to a text model; mixed in before the text family's Model (`_model_class`)."""

    PROMPTER = ImagePrompter
    TEXT_PREFIXES, VISION_PREFIXES = LLAVA_TEXT_PREFIXES, LLAVA_VISION_PREFIXES
    DROPPED_VISION = ("head.",)  # a SigLIP tower's pooling head: unused

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__(args)  # the text family's Model
        self.vision = args.extra.get("vision")
        if self.vision is not None:
            config = self.vision["vision_config"]
            is_clip = config.get("model_type", "clip_vision_model") == "clip_vision_model"
            recipe = VisionRecipe.from_config(config, class_token=is_clip, pre_norm=is_clip, patch_bias=not is_clip,
                                              post_norm=not self.vision.get("drops_post_norm", False))
            self.vision_tower = VisionTransformer(recipe)
            self.multi_modal_projector = Projector(self.vision, args.hidden_size)

    def encode_images(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        assert self.vision is not None
        pixels = pixel_batch(images, self.multi_modal_projector.linear_1.weight)
        features = self.vision_tower(pixels, feature_layer=int(self.vision.get("vision_feature_layer", -2)))
        if self.vision.get("vision_feature_select_strategy", "default") == "default" and self.vision_tower.recipe.class_token:
            features = features[:, 1:]
        return list(self.multi_modal_projector(features).unbind(0))


@functools.cache
def _model_class(text: ModuleType) -> type[nn.Module]:
    return type(f"Llava{text.Model.__name__}", (LlavaVision, text.Model), {"ARGS": text.ModelArgs})


class Model(nn.Module):
    """Builds the text family's Model with LLaVA's vision side (`LlavaVision` mixed in)."""

    def __new__(cls, args: DecoderArgs) -> nn.Module:  # type: ignore[misc]
        return _model_class(_text_module(args.extra))(args)

    @classmethod
    def sanitize(cls, weights: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
        return _model_class(_text_module(args.extra)).sanitize(weights, args)


# ---- llama.cpp's projector file (--mmproj, loading/mmproj.py) ----

MMPROJ_TEXT_MODELS = (DecoderLM,)  # LLaVA 1.5's text GGUF is its text family's own (llama)


def attach_mmproj(model: DecoderLM, mmproj: Any, tokenizer: PromptTokenizer) -> None:
    """The CLIP tower and two-layer projector (`mm.0`, `mm.2`) of the "mlp" mmproj that llama.cpp's CLIP converter
    (tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py) writes for LLaVA 1.5, attached to a text model
    loaded from GGUF, which becomes LLaVA's Model over its family. The converter keeps only the layers up to
    the feature layer and drops the final norm, so the features are the last kept layer's output."""
    from mlxcel.models import _mmproj

    config = {**_mmproj.vision_config(mmproj, default_eps=1e-5), "model_type": "clip_vision_model",
              "hidden_act": "gelu" if mmproj.metadata.get("clip.use_gelu", True) else "quick_gelu"}
    vision = {"vision_config": config, "vision_feature_layer": -1, "vision_feature_select_strategy": "default",
              "projector_hidden_act": "gelu", "multimodal_projector_bias": "mm.0.bias" in mmproj.tensors,
              "image_token_index": single_token(tokenizer, "<image>", "llava"), "drops_post_norm": True,
              "image_processor": {"image_mean": list(_mmproj.clip_value(mmproj, "image_mean")),
                                  "image_std": list(_mmproj.clip_value(mmproj, "image_std"))}}
    param = next(model.parameters())
    projector = Projector(vision, model.args.hidden_size)
    projector.load_state_dict({f"linear_{i}.{kind}": _mmproj.tensor(mmproj, f"mm.{index}.{kind}")
                               for i, index in ((1, 0), (2, 2)) for kind in ("weight", "bias")
                               if f"mm.{index}.{kind}" in mmproj.tensors}, strict=True)
    model.__class__ = _model_class(importlib.import_module(type(model).__module__))  # NOTE: adds the vision side only
    model.vision_tower = _mmproj.load_tower(mmproj, config, param, class_token=True, pre_norm=True, patch_bias=False,
                                            post_norm=False)
    model.multi_modal_projector = projector.to(param.device, param.dtype).eval()
    model.vision = vision
