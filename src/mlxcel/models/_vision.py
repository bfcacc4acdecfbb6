"""The vision-language family interface (issue 43): how a family declares its vision side, and
how the server and the engine use it. Keep it stable: other families build on it.

A vision-language family module (gemma3, idefics3, llava, ...) is a text family plus:

1. `IS_VISION_LANGUAGE = True` at module level. `loading.checkpoint.hf_config` then keeps the
   checkpoint's top-level model_type (e.g. `gemma3`, `llava`) for a config with a `text_config` and a
   `vision_config`, reads the text fields from `text_config` as before, and puts the whole top-level
   config (vision_config, image_token_id, mm_tokens_per_image, ...) under `config["vision"]`, which
   `DecoderArgs.from_dict` leaves in `args.extra["vision"]`. Without it the model is text only.
2. `Model` (a `VisionLanguageModel`) holds the tower and projector as modules named as the checkpoint
   names them (`vision_tower.vision_model.*`, `multi_modal_projector.*`; the shared blocks are in
   layers/vision.py) and implements
       `encode_images(images: Sequence[ImageInput]) -> list[Tensor]`: one [image.num_tokens, hidden]
       tensor per image, the embeddings that replace the image's placeholder tokens, in
       placeholder-position order; called on the engine thread, once per image, batched over
       every image that a step's prefill chunks need;
       `image_prompter(model_dir, tokenizer) -> ImagePrompter`: the processor side (below).
   The text forward takes `embeds` (layers.decoder.EmbeddingOverride: rows of the step's flat
   token batch and their embeddings) and writes them over those rows' token embeddings.
3. The processor side, an `ImagePrompter` (types.py) made by `image_prompter`: `marker` is the text
   an image part renders as in the chat prompt (Gemma 3's `<start_of_image>`, SmolVLM's `<image>`);
   `prepare(token_ids, images)` decodes and resizes each image with the checkpoint's processor
   settings (transformers' own image processor class, built from preprocessor_config.json, or the
   family's defaults from the config when the file is absent), expands each marker token into the
   image's placeholder tokens (how many: the processor's own count) and returns the expanded ids
   and one `ImageInput` per image: its placeholder runs, its pixel tensors, its content digest
   (the prefix cache keys blocks by it: same image and text hit, another image misses) and whether
   its runs attend bidirectionally (Gemma 3).

The API layer calls `prepare` off the event loop (after the media checks of api/media.py), before
the prompt's length is checked, so image tokens count in `usage` and an over-long prompt is a 400
before any work. The engine runs `encode_images` when a prefill chunk first needs a placeholder
position that is not in the prefix cache (a fully cached image is never encoded again).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from mlxcel.types import ImageInput, ImagePrompter

__all__ = ["ImageInput", "ImagePrompter", "PromptTokenizer", "VisionLanguageModel", "config_token", "decode_image",
           "expand_markers", "image_digest", "load_image_processor", "own_name", "pixel_batch", "placeholder_runs",
           "split_runs", "VisionFamily"]

class PromptTokenizer(Protocol):
    """What a processor side needs of the tokenizer (text.tokenizer.Tokenizer is one)."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...


class VisionLanguageModel(Protocol):
    def encode_images(self, images: Sequence[ImageInput]) -> list[torch.Tensor]: ...

    def image_prompter(self, model_dir: Path | None, tokenizer: PromptTokenizer) -> ImagePrompter: ...


class VisionFamily:
    """The parts every VLM family's Model shares, mixed in before its text Model: `image_prompter` (the
    family's `PROMPTER` class over `self.vision`, the top-level config) and `sanitize` (the checkpoint's
    names by the family's prefix tables, `own_name`, then the text Model's own sanitize)."""

    PROMPTER: ClassVar[Any]
    TEXT_PREFIXES: ClassVar[Mapping[str, str]]
    VISION_PREFIXES: ClassVar[Mapping[str, str]]
    DROPPED_VISION: ClassVar[tuple[str, ...]] = ()  # vision weights the family never reads (after the prefix)
    vision: dict[str, Any] | None

    def image_prompter(self, model_dir: Path | None, tokenizer: PromptTokenizer) -> ImagePrompter:
        if self.vision is None:
            raise ValueError(f"this {type(self).__module__} checkpoint has no vision tower")
        return self.PROMPTER(self.vision, model_dir, tokenizer)

    @classmethod
    def sanitize(cls, weights: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        has_vision = args.extra.get("vision") is not None
        kept = {new: value for name, value in weights.items()
                if (new := own_name(name, dict(cls.TEXT_PREFIXES), dict(cls.VISION_PREFIXES), has_vision=has_vision,
                                    dropped=cls.DROPPED_VISION)) is not None}
        return super().sanitize(kept, args)  # type: ignore[misc]


def pixel_batch(images: Sequence[ImageInput], like: torch.Tensor) -> torch.Tensor:
    """Every image's `pixel_values` in one batch, on `like`'s device and in its dtype."""
    return torch.cat([image.pixels["pixel_values"] for image in images]).to(like.device, like.dtype)


def config_token(config: dict[str, Any], *names: str) -> int:
    """A token id of a multimodal config, under the first of `names` present (configs spell them
    `image_token_index` or `image_token_id`)."""
    for name in names:
        if config.get(name) is not None:
            return int(config[name])
    raise ValueError(f"the config gives none of {', '.join(names)}")


def single_token(tokenizer: PromptTokenizer, text: str, family: str) -> int:
    """The one token id `text` encodes to (an image marker such as `[IMG_BREAK]`); ValueError naming `family`
    where the vocabulary spells it in several tokens or none."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{family}: the tokenizer has no {text} token")
    return ids[0]


# Where a LLaVA-style *ForConditionalGeneration checkpoint keeps its parts, in transformers 4's and 5's layouts: the
# text model, and the vision tower (its own `vision_model.` level dropped: hub checkpoints have it, transformers 5
# saves without it) and projector (gemma3, llava; qwen3_next keeps the text part alone).
LLAVA_TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                       "language_model.lm_head.": "lm_head."}
LLAVA_VISION_PREFIXES = {"model.vision_tower.vision_model.": "vision_tower.",
                         "vision_tower.vision_model.": "vision_tower.",
                         "model.vision_tower.": "vision_tower.", "vision_tower.": "vision_tower.",
                         "model.multi_modal_projector.": "multi_modal_projector.",
                         "multi_modal_projector.": "multi_modal_projector."}


def image_digest(data: bytes) -> str:
    """The prefix-cache key of an image: sha256 of its encoded bytes."""
    return hashlib.sha256(data).hexdigest()


def decode_image(data: bytes) -> Any:
    """An RGB Pillow image of `data` (already checked by media/images.py's caps)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


def load_image_processor(model_dir: Path | None, processor_class: type, **defaults: Any) -> Any:
    """The checkpoint's image processor (its preprocessor_config.json), else `processor_class(**defaults)`."""
    if model_dir is not None and (model_dir / "preprocessor_config.json").is_file():
        return processor_class.from_pretrained(str(model_dir))
    return processor_class(**defaults)


def placeholder_runs(token_ids: Sequence[int], placeholder: int) -> list[tuple[int, int]]:
    """The (start, length) runs of `placeholder` in `token_ids`, in order."""
    runs: list[tuple[int, int]] = []
    for index, token in enumerate(token_ids):
        if token != placeholder:
            continue
        if runs and runs[-1][0] + runs[-1][1] == index:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((index, 1))
    return runs


def split_runs(runs: Sequence[tuple[int, int]], lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Adjacent images' placeholders merge into one run: the runs cut into one run per image, of `lengths`
    (each image's placeholder count, in order)."""
    positions = iter([start + i for start, total in runs for i in range(total)])
    out = []
    for length in lengths:
        first = next(positions)
        for _ in range(length - 1):
            next(positions)
        out.append((first, length))
    return out


def own_name(name: str, text_prefixes: dict[str, str], vision_prefixes: dict[str, str], *, has_vision: bool,
             dropped: tuple[str, ...] = ()) -> str | None:
    """A multimodal checkpoint's parameter name as our module names it: the text model's under `model.` /
    `lm_head.`, the vision side's under the family's own names (kept only when the model has its tower);
    None to drop it (vision weights of a text-only build; names the family never reads, `dropped`, after
    the vision prefix)."""
    for prefix, replacement in vision_prefixes.items():
        if name.startswith(prefix):
            rest = name[len(prefix):]
            return replacement + rest if has_vision and not rest.startswith(dropped) else None
    for prefix, replacement in text_prefixes.items():
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name


def expand_markers(token_ids: Sequence[int], marker: int, expansions: Sequence[list[int]]) -> list[int]:
    """`token_ids` with the i-th `marker` replaced by `expansions[i]`; raises ValueError on a count mismatch."""
    count = sum(token == marker for token in token_ids)
    if count != len(expansions):
        raise ValueError(f"the prompt holds {count} image markers for {len(expansions)} images")
    parts = iter(expansions)
    out: list[int] = []
    for token in token_ids:
        out.extend(next(parts) if token == marker else (token,))
    return out
