"""Tiny Qwen2.5-VL, Qwen3-VL and Mistral 3 checkpoints made by transformers (issue 43, part B):
random weights (2 text layers, hidden 64; a 2-3 block vision tower of width 32), vision_checkpoints'
byte-level tokenizer with the family's image tokens, and the family's image processor saved beside them
(preprocessor_config.json: small pixel bounds keep the patch grids to a few dozen patches).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from .vision_checkpoints import EOS, png, write_tokenizer

__all__ = ["EOS", "png", "write_mistral3", "write_qwen_vl"]

QWEN_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
MISTRAL3_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
TEXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            max_position_embeddings=1024)


def _save(model: torch.nn.Module, processor: Any, folder: Path, seed: int) -> torch.nn.Module:
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        for p in model.parameters():  # larger than the init keeps logits far from ties
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    model.eval().save_pretrained(folder)
    processor.save_pretrained(folder)
    return model


def write_qwen_vl(folder: Path, family: str, seed: int = 0) -> tuple[torch.nn.Module, dict[str, int]]:
    """`family` "qwen2_5_vl" (windows of 2 x 2 merged tokens, block 1 full) or "qwen3_vl" (deepstack
    after blocks 0 and 1); the reference model (float32, eval) and the special tokens' ids."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(folder, QWEN_TOKENS)
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                  tie_word_embeddings=False)
    vision = dict(hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, spatial_merge_size=2,
                  temporal_patch_size=2)
    text = {**TEXT, "vocab_size": 256 + 1 + len(QWEN_TOKENS)}
    if family == "qwen2_5_vl":
        config = transformers.Qwen2_5_VLConfig(
            text_config={**text, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                                     "rope_theta": 10000.0}},
            vision_config={**vision, "depth": 2, "patch_size": 14, "window_size": 56, "fullatt_block_indexes": [1]},
            **tokens)
        model, patch = transformers.Qwen2_5_VLForConditionalGeneration(config), 14
    else:
        config = transformers.Qwen3VLConfig(
            text_config={**text, "head_dim": 16, "rope_parameters": {
                "rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True, "rope_theta": 10000.0}},
            vision_config={**vision, "depth": 3, "patch_size": 16, "num_position_embeddings": 16,
                           "deepstack_visual_indexes": [0, 1]},
            **tokens)
        model, patch = transformers.Qwen3VLForConditionalGeneration(config), 16
    unit = patch * 2  # one merged token covers unit x unit pixels
    processor = transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil(
        min_pixels=unit * unit * 4, max_pixels=unit * unit * 30, patch_size=patch, merge_size=2, temporal_patch_size=2)
    return _save(model, processor, folder, seed), ids


def write_mistral3(folder: Path, seed: int = 0) -> tuple[torch.nn.Module, dict[str, int]]:
    """A Mistral3ForConditionalGeneration over the mistral text family (Pixtral of 8-pixel patches,
    images up to 64 pixels a side); the reference model and the special tokens' ids."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(folder, MISTRAL3_TOKENS)
    config = transformers.Mistral3Config(
        text_config={**TEXT, "model_type": "mistral", "head_dim": 16, "vocab_size": 256 + 1 + len(MISTRAL3_TOKENS)},
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, head_dim=16, patch_size=8, image_size=64),
        image_token_index=ids["[IMG]"], spatial_merge_size=2, tie_word_embeddings=False)
    processor = transformers.models.pixtral.image_processing_pil_pixtral.PixtralImageProcessorPil(
        size={"longest_edge": 64}, patch_size=8)
    return _save(transformers.Mistral3ForConditionalGeneration(config), processor, folder, seed), ids
