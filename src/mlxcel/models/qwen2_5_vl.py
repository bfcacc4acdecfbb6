"""Qwen2.5-VL: Qwen2's decoder with M-RoPE (three rotary sections turned by temporal, height and
width positions) under the Qwen-VL vision tower (layers/vision_qwen.py: windowed ViT, 2-D rope,
patch merger), whose tokens replace the prompt's image placeholder tokens (models/_vision.py).

An image renders in the chat prompt as `<|vision_start|><|image_pad|><|vision_end|>`, and its
`<|image_pad|>` becomes one pad a merged token (t * h * w / m^2, the grid transformers' Qwen2-VL
image processor picks for the image's size); a video as `<|vision_start|><|video_pad|><|vision_end|>`,
its frames paired into temporal patches (t = frames / 2), whose M-RoPE temporal positions step by
tokens_per_second * 2 / fps. Positions: `rope_positions` gives the prompt's
M-RoPE positions [3, len] and the offset of every later position (index + offset on all three rows).

Checkpoint names as the Hub has them: `model.*` (the text decoder), `visual.*`, `lm_head`;
transformers 5's in-memory `model.language_model.*` / `model.visual.*` are renamed on load (`VisionFamily`'s tables).
`QwenVLFields`, `QwenVLModel` and `QwenImagePrompter` are what qwen3_vl shares.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from mlxcel.layers.decoder import DecoderLM, RopeRecipe
from mlxcel.layers.vision_qwen import QwenVisionTower, VisionSpec, mrope_positions
from mlxcel.models import qwen2
from mlxcel.models._vision import (
    ImageInput, PromptTokenizer, VisionFamily, config_token, decode_image, expand_markers, image_digest,
    load_image_processor,
)

IS_VISION_LANGUAGE = True


@dataclass(frozen=True)
class QwenVLFields:
    """The M-RoPE part of a Qwen-VL config, mixed into a text family's ModelArgs; the vision part is
    the top-level config that loading keeps in `extra["vision"]` (models/_vision.py)."""

    mrope_section: tuple[int, ...] = (16, 24, 24)
    mrope_interleaved: bool = False

    IS_V3: ClassVar[bool] = False

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        if "vision" not in config and "vision_config" in config:  # transformers 4's flat form (most Hub checkpoints)
            config = {**config, "vision": dict(config)}
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        section = tuple(rope.get("mrope_section") or cls.mrope_section)
        interleaved = bool(rope.get("mrope_interleaved", cls.mrope_interleaved))
        config = super().prepare(config)  # type: ignore[misc]
        if config.get("sliding_window"):  # the decode step's query positions are M-RoPE's, not the cache's
            raise ValueError("sliding-window attention with M-RoPE is not supported")
        return {**config, "mrope_section": section, "mrope_interleaved": interleaved}

    @property
    def vision_spec(self) -> VisionSpec:
        return VisionSpec.of(self.extra["vision"]["vision_config"], is_v3=self.IS_V3)  # type: ignore[attr-defined]

    def layer_rope(self, layer_idx: int) -> RopeRecipe:
        scaling = {**(self.rope_scaling or {}), "rope_type": "mrope", "mrope_section": list(self.mrope_section),  # type: ignore[attr-defined]
                   "mrope_interleaved": self.mrope_interleaved}
        return RopeRecipe.of(self.rope_theta, scaling, self.dim_per_head)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class ModelArgs(QwenVLFields, qwen2.ModelArgs):
    pass


class QwenVLModel(VisionFamily, DecoderLM):
    """A Qwen-VL model: the text decoder with the vision tower `visual` beside it."""

    TEXT_PREFIXES: ClassVar[Mapping[str, str]] = {"model.language_model.": "model."}  # transformers 5 in memory
    VISION_PREFIXES: ClassVar[Mapping[str, str]] = {"model.visual.": "visual.", "visual.": "visual."}

    def __init__(self, args: Any) -> None:
        super().__init__(args)
        self.vision = args.extra.get("vision")
        if self.vision is None:
            raise ValueError(f"{type(self).__module__}: the config has no vision_config")
        self.visual = QwenVisionTower(args.vision_spec)

    def encode_images(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Every image or video (one grid each) through the tower in one batch: each one's rows
        [n_i, width] for its placeholders, the input embedding then (Qwen3-VL) each deepstack layer's
        addition side by side."""
        weight = self.visual.patch_embed.proj.weight
        pixels = torch.cat([image.pixels["pixel_values"] for image in images]).to(weight.device, weight.dtype)
        grids = [_grid(image) for image in images]
        outputs = self.visual(pixels, grids)
        rows = torch.cat(outputs, dim=-1) if len(outputs) > 1 else outputs[0]
        return list(rows.split([self.args.vision_spec.tokens_of(g) for g in grids]))

    def rope_positions(self, token_ids: Sequence[int], images: Sequence[ImageInput]) -> tuple[torch.Tensor, int]:
        """M-RoPE positions [3, len] of a prompt holding `images`, and the offset of every later
        position (the next token's position is its index plus the offset)."""
        spec = self.args.vision_spec
        grids = [_grid(image) for image in images]
        steps = [spec.tokens_per_second * float(image.pixels["second_per_grid"]) if "second_per_grid" in image.pixels
                 else 1.0 for image in images]
        return mrope_positions(list(token_ids), grids, self._placeholder_ids(), spec.spatial_merge_size, steps)

    def _placeholder_ids(self) -> tuple[int, ...]:
        return (config_token(self.vision, "image_token_id"), config_token(self.vision, "video_token_id"))

    def image_prompter(self, model_dir: Path | None, tokenizer: PromptTokenizer) -> QwenImagePrompter:
        return QwenImagePrompter(self.vision, self.args.vision_spec, model_dir, tokenizer)



def _grid(image: ImageInput) -> tuple[int, int, int]:
    t, h, w = (int(v) for v in image.pixels["image_grid_thw"].reshape(3).tolist())
    return t, h, w


class QwenImagePrompter:
    """The processor side (models/_vision.py): transformers' Qwen2-VL image processor with the
    checkpoint's settings (dynamic resolution: the grid follows the image's size between its
    min and max pixels); each `<|image_pad|>` of the prompt becomes that image's pads."""

    def __init__(self, vision: dict[str, Any], spec: VisionSpec, model_dir: Path | None,
                 tokenizer: PromptTokenizer) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.spec = spec
        self.processor = load_image_processor(
            model_dir, Qwen2VLImageProcessorPil, patch_size=spec.patch_size, merge_size=spec.spatial_merge_size,
            temporal_patch_size=spec.temporal_patch_size)
        self.pad = config_token(vision, "image_token_id")
        self.video_pad = config_token(vision, "video_token_id")
        start, end = config_token(vision, "vision_start_token_id"), config_token(vision, "vision_end_token_id")
        self.marker = tokenizer.decode([start, self.pad, end], skip_special_tokens=False)
        # Qwen3-VL separates a video's frames by timestamps, which this prompter does not write
        self.video_marker = None if spec.is_v3 else tokenizer.decode([start, self.video_pad, end],
                                                                     skip_special_tokens=False)

    def prepare(self, token_ids: list[int], images: Sequence[bytes]) -> tuple[list[int], tuple[ImageInput, ...]]:
        return self.prepare_media(token_ids, images, ())

    def prepare_media(self, token_ids: list[int], images: Sequence[bytes],
                      videos: Sequence[tuple[Sequence[bytes], float]]) -> tuple[list[int], tuple[ImageInput, ...]]:
        """`prepare` with videos too (frames, fps), each `<|video_pad|>` one video's temporal patches
        (two frames each); the inputs in prompt order."""
        if videos and self.video_marker is None:
            raise ValueError("this model's video input is not supported")
        stills = [self._image(data) for data in images]
        clips = [self._video(frames, fps) for frames, fps in videos]
        expanded = expand_markers(token_ids, self.pad, [[self.pad] * self.spec.tokens_of(g) for _, g, _ in stills])
        expanded = expand_markers(expanded, self.video_pad, [[self.video_pad] * self.spec.tokens_of(g) for _, g, _ in clips])
        inputs = [*self._inputs(expanded, self.pad, stills), *self._inputs(expanded, self.video_pad, clips)]
        return expanded, tuple(sorted(inputs, key=lambda image: image.runs[0][0]))

    def _image(self, data: bytes) -> tuple[str, tuple[int, int, int], dict[str, torch.Tensor]]:
        processed = self.processor(images=[decode_image(data)], return_tensors="pt")
        grid = tuple(int(v) for v in processed["image_grid_thw"][0])
        return image_digest(data), grid, {"pixel_values": processed["pixel_values"], "image_grid_thw": torch.tensor([grid])}

    def _video(self, frames: Sequence[bytes], fps: float) -> tuple[str, tuple[int, int, int], dict[str, torch.Tensor]]:
        """A video's temporal patches: each frame resized and normalised as an image (the size of its
        first), consecutive frames paired into one patch (the last repeated to an even count)."""
        size = decode_image(frames[0]).size
        decoded = [decode_image(data).resize(size) for data in frames]
        tp = self.spec.temporal_patch_size
        decoded += [decoded[-1]] * (-len(decoded) % tp)
        processed = self.processor(images=decoded, return_tensors="pt")
        _, h, w = (int(v) for v in processed["image_grid_thw"][0])
        # [frames, h * w, C, tp, P, P] (a still's tp copies are equal): one copy of each frame,
        # then frames t*tp..t*tp+tp-1 side by side -> [t * h * w, C * tp * P * P]
        per_frame = processed["pixel_values"].view(len(decoded), h * w, -1, tp, self.spec.patch_size**2)[:, :, :, 0]
        t = len(decoded) // tp
        pixels = per_frame.view(t, tp, h * w, -1, self.spec.patch_size**2).permute(0, 2, 3, 1, 4).reshape(t * h * w, -1)
        digest = image_digest(b"".join(bytes.fromhex(image_digest(data)) for data in frames))
        return digest, (t, h, w), {"pixel_values": pixels, "image_grid_thw": torch.tensor([[t, h, w]]),
                                   "second_per_grid": torch.tensor(tp / fps)}

    def _inputs(self, expanded: list[int], pad: int,
                processed: list[tuple[str, tuple[int, int, int], dict[str, torch.Tensor]]]) -> list[ImageInput]:
        inputs, search = [], 0
        for digest, grid, pixels in processed:
            start, count = expanded.index(pad, search), self.spec.tokens_of(grid)
            inputs.append(ImageInput(digest, ((start, count),), pixels))
            search = start + count
        return inputs


class Model(QwenVLModel):
    ARGS = ModelArgs
