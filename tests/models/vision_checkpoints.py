"""Tiny vision-language checkpoints made by transformers (issue 43): random weights, a byte-level
tokenizer with the family's image tokens, a chat template, and the family's processor settings.

`write_gemma3_vlm` writes a Gemma3ForConditionalGeneration (2 text layers, hidden 64; a 2-layer SigLIP
of 32x32 pixels in 4x4 patches pooled to 4 soft tokens) with preprocessor_config.json, so the server
loads it as a user's hub folder. `png` makes deterministic test images.
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


def gemma3_config(ids: dict[str, int], vocab_size: int) -> transformers.Gemma3Config:
    text = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=vocab_size, max_position_embeddings=512, head_dim=16,
                query_pre_attn_scalar=16, sliding_window=8, sliding_window_pattern=2)
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
                  patch_size=4, vision_use_head=False)
    return transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<image_soft_token>"])


def write_gemma3_vlm(folder: Path, seed: int = 0) -> tuple[torch.nn.Module, dict[str, int]]:
    """The reference model (float32, eval) and the special tokens' ids."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(folder, GEMMA3_IMAGE_TOKENS)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(gemma3_config(ids, 256 + 1 + len(GEMMA3_IMAGE_TOKENS)))
    with torch.no_grad():
        for p in model.parameters():  # larger than the init keeps logits far from ties
            p.normal_(0.0, 0.2)
    model.eval().save_pretrained(folder)
    processor = transformers.models.gemma3.image_processing_pil_gemma3.Gemma3ImageProcessorPil(
        size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor.save_pretrained(folder)
    return model, ids


def png(seed: int, width: int = 40, height: int = 30, fmt: str = "PNG") -> bytes:
    """A random RGB image, encoded."""
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()
