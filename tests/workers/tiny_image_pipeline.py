"""A tiny Stable Diffusion pipeline with random weights, written to disk for the image tests (spec J).

The real architecture (UNet2DConditionModel, AutoencoderKL, CLIPTextModel, CLIPTokenizer, DDIM)
at toy sizes, saved by diffusers' own `save_pretrained`, so the server loads it through the real
path (`DiffusionPipeline.from_pretrained`). The tokenizer is built offline: a byte-level vocabulary
(each byte's character, alone and word-final) with no merges. The tests' VAE downsamples by 2, so
sizes are multiples of 2 and the default size is 16x16. `bench/image_gen.py` builds a larger one.
"""

from __future__ import annotations

import json
from pathlib import Path


def _byte_characters() -> list[str]:
    # GPT-2's printable stand-ins for the 256 byte values, which CLIP's byte-level BPE expects.
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    spare = iter(range(256, 512))
    return [chr(value) if value in printable else chr(next(spare)) for value in range(256)]


def write_tokenizer_files(folder: Path) -> tuple[Path, Path, dict[str, int]]:
    characters = _byte_characters()
    vocab = {token: index for index, token in enumerate(characters + [c + "</w>" for c in characters])}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return folder / "vocab.json", folder / "merges.txt", vocab


def write_tiny_pipeline(folder: Path, *, channels: tuple[int, int] = (8, 16), vae_channels: tuple[int, ...] = (8, 16),
                        sample_size: int = 8, max_length: int = 32, seed: int = 0) -> Path:
    """Save a random-weight StableDiffusionPipeline under `folder`; returns the folder.

    The VAE downsamples by 2 per block after the first: `vae_channels` of length 4 gives Stable
    Diffusion's factor 8 (the benchmark's 512x512 is a 64x64 latent), the tests' default of length 2
    a factor 2. The default size is `sample_size` times that factor.
    """
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab_file, merges_file, vocab = write_tokenizer_files(folder.parent / f"{folder.name}-tokenizer-source")
    tokenizer = CLIPTokenizer(str(vocab_file), str(merges_file), model_max_length=max_length)
    torch.manual_seed(seed)
    groups = channels[0]
    unet = UNet2DConditionModel(
        block_out_channels=channels, layers_per_block=1, sample_size=sample_size, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, norm_num_groups=groups, attention_head_dim=4)
    vae = AutoencoderKL(
        block_out_channels=vae_channels, in_channels=3, out_channels=3, latent_channels=4,
        norm_num_groups=vae_channels[0], down_block_types=("DownEncoderBlock2D",) * len(vae_channels),
        up_block_types=("UpDecoderBlock2D",) * len(vae_channels),
        sample_size=sample_size * 2 ** (len(vae_channels) - 1))
    text_encoder = CLIPTextModel(CLIPTextConfig(
        bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"], hidden_size=32,
        intermediate_size=37, num_attention_heads=4, num_hidden_layers=2, vocab_size=len(vocab),
        max_position_embeddings=max_length, projection_dim=32))
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    pipeline = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                       scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)
    pipeline.save_pretrained(folder)
    return folder
