"""Tiny vision-language checkpoints made by transformers (issue 43): random weights, a byte-level
tokenizer with the family's image tokens, a chat template, and the family's processor settings.

`write_gemma3_vlm` writes a Gemma3ForConditionalGeneration (2 text layers, hidden 64; a 2-layer SigLIP
of 32x32 pixels in 4x4 patches pooled to 4 soft tokens), `write_idefics3_vlm` an Idefics3 / SmolVLM
(Llama text, 32x32 tiles of 4x4 patches, pixel shuffle by 2: 16 tokens a tile), each with its
preprocessor_config.json, so the server loads it as a user's hub folder. `png` makes test images.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch
import transformers

EOS = "<|endoftext|>"
GEMMA3_IMAGE_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


def write_tokenizer(folder: Path, specials: list[str]) -> dict[str, int]:
    """A byte-level BPE (the 256 byte characters) plus EOS and `specials`; their ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in [EOS, *specials]])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "bos_token": None, "chat_template": TEMPLATE, "add_bos_token": False}))
    return {t: tokenizer.token_to_id(t) for t in [EOS, *specials]}


def save_random(model: torch.nn.Module, folder: Path) -> torch.nn.Module:
    """`model` with every parameter drawn from N(0, 0.2) (larger than the init keeps logits far from ties),
    saved in HF layout; returned in eval mode."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.eval().save_pretrained(folder)
    return model


def gemma3_config(ids: dict[str, int], vocab_size: int, pattern: int = 2) -> transformers.Gemma3Config:
    text = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=vocab_size, max_position_embeddings=512, head_dim=16,
                query_pre_attn_scalar=16, sliding_window=8, sliding_window_pattern=pattern)
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
                  patch_size=4, vision_use_head=False)
    return transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<image_soft_token>"])


def write_gemma3_vlm(folder: Path, seed: int = 0, pattern: int = 2) -> tuple[torch.nn.Module, dict[str, int]]:
    """The reference model (float32, eval) and the special tokens' ids; every `pattern`-th text layer global."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(folder, GEMMA3_IMAGE_TOKENS)
    torch.manual_seed(seed)
    model = save_random(transformers.Gemma3ForConditionalGeneration(
        gemma3_config(ids, 256 + 1 + len(GEMMA3_IMAGE_TOKENS), pattern)), folder)
    processor = transformers.models.gemma3.image_processing_pil_gemma3.Gemma3ImageProcessorPil(
        size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor.save_pretrained(folder)
    return model, ids


IDEFICS3_IMAGE_TOKENS = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
                         *[f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]]


def write_idefics3_vlm(folder: Path, seed: int = 0) -> tuple[torch.nn.Module, dict[str, int]]:
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(folder, IDEFICS3_IMAGE_TOKENS)
    text = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=256 + 1 + len(IDEFICS3_IMAGE_TOKENS), max_position_embeddings=1024)
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
                  patch_size=4)
    config = transformers.Idefics3Config(text_config=transformers.LlamaConfig(**text), vision_config=vision,
                                         scale_factor=2, image_token_id=ids["<image>"])
    torch.manual_seed(seed)
    model = save_random(transformers.Idefics3ForConditionalGeneration(config), folder)
    processor = transformers.models.idefics3.image_processing_pil_idefics3.Idefics3ImageProcessorPil(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    processor.save_pretrained(folder)
    return model, ids


def _llava_parts() -> tuple[transformers.LlamaConfig, transformers.CLIPVisionConfig]:
    """The text and vision configs of the LLaVA-style test checkpoints: Llama text, a 16x16 CLIP tower."""
    text = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=128, vocab_size=256 + 2, max_position_embeddings=512)
    vision = transformers.CLIPVisionConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                           intermediate_size=64, image_size=16, patch_size=4)
    return text, vision


def write_llava_vlm(folder: Path, seed: int = 0) -> tuple[torch.nn.Module, dict[str, int]]:
    """LLaVA over a Llama text model: a CLIP tower of 16x16 pixels in 4x4 patches (16 tokens, class token dropped)."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(folder, ["<image>"])
    text, vision = _llava_parts()
    config = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=ids["<image>"])
    torch.manual_seed(seed)
    model = save_random(transformers.LlavaForConditionalGeneration(config), folder)
    transformers.CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}).save_pretrained(
        folder)
    return model, ids


LLAVA_NEXT_PINPOINTS = [[16, 32], [32, 16]]


def write_llava_next_vlm(folder: Path, seed: int = 0) -> tuple[torch.nn.Module, dict[str, int]]:
    """LLaVA-NeXT over a Llama text model: LLaVA's 16x16 CLIP tower, anyres tiles of 16x16 pixels on a grid of
    1 x 2 or 2 x 1 (`LLAVA_NEXT_PINPOINTS`), unpadding and a row newline."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(folder, ["<image>"])
    text, vision = _llava_parts()
    config = transformers.LlavaNextConfig(text_config=text, vision_config=vision, image_token_index=ids["<image>"],
                                          image_grid_pinpoints=LLAVA_NEXT_PINPOINTS)
    torch.manual_seed(seed)
    model = save_random(transformers.LlavaNextForConditionalGeneration(config), folder)
    transformers.LlavaNextImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
                                         image_grid_pinpoints=LLAVA_NEXT_PINPOINTS).save_pretrained(folder)
    return model, ids


def png(seed: int, width: int = 40, height: int = 30, fmt: str = "PNG") -> bytes:
    """A random RGB image, encoded."""
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()
