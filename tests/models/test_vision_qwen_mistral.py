"""Issue 43 (part B): Qwen2.5-VL, Qwen3-VL and Mistral 3 from tiny random checkpoints transformers
writes, loaded by our loader, images processed by our prompter (the checkpoint's own image processor).

For one and two images our logits equal transformers' float32 forward on the same token ids and
pixels, and greedy tokens through the real engine (paged KV, prompts in chunks, the decode step at
M-RoPE's offset positions, prefix-cache hits) equal transformers' `generate`. The M-RoPE table is
checked against transformers' rotary on the same 3-D positions too.
"""

from __future__ import annotations

from pathlib import Path

import asyncio

import pytest
import torch
import transformers

from mlxcel.layers.attention import AttentionContext, SequenceSlice
from mlxcel.layers.decoder import EmbeddingOverride
from mlxcel.layers.rope import MRotaryEmbedding
from mlxcel.loading import load_model
from mlxcel.text.tokenizer import Tokenizer
from mlxcel.types import ImageInput

from .test_vision_families import NUM_TOKENS, _engine, _generate
from .vision_qwen_checkpoints import png, write_mistral3, write_qwen_vl

TOL_VS_TRANSFORMERS = 2e-5
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "mistral3")
IMAGES = (png(1, 200, 120), png(2, 60, 90))  # Qwen2.5-VL: 4 x 7 merged tokens, in windows of 2 x 2


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp(request.param)
    reference, ids = write_mistral3(folder) if request.param == "mistral3" else write_qwen_vl(folder, request.param)
    model = load_model(folder).model
    tokenizer = Tokenizer.from_pretrained_dir(folder)
    return request.param, reference, model, model.image_prompter(folder, tokenizer), tokenizer


def _prompt(family, num_images: int) -> tuple[list[int], tuple[ImageInput, ...]]:
    _, _, _, prompter, tokenizer = family
    text = "Describe" + "".join(f" {prompter.marker} then" for _ in range(num_images)) + " please."
    return prompter.prepare(tokenizer.encode(text, add_special_tokens=False), IMAGES[:num_images])


def _reference_inputs(family, ids: list[int], images: tuple[ImageInput, ...]) -> dict[str, torch.Tensor]:
    name, _, model, _, _ = family
    inputs = {"input_ids": torch.tensor([ids])}
    if name == "mistral3":
        sizes = [image.pixels["pixel_values"].shape[1:] for image in images]
        height, width = max(s[0] for s in sizes), max(s[1] for s in sizes)
        padded = torch.zeros(len(images), 3, height, width)
        for i, image in enumerate(images):
            pixels = image.pixels["pixel_values"]
            padded[i, :, :pixels.shape[1], :pixels.shape[2]] = pixels
        return {**inputs, "pixel_values": padded, "image_sizes": torch.tensor([list(s) for s in sizes])}
    image_token = model.vision["image_token_id"]
    return {**inputs, "pixel_values": torch.cat([image.pixels["pixel_values"] for image in images]),
            "image_grid_thw": torch.cat([image.pixels["image_grid_thw"] for image in images]),
            "mm_token_type_ids": torch.tensor([[int(t == image_token) for t in ids]])}


def _positions(model, ids: list[int], images: tuple[ImageInput, ...]) -> tuple[torch.Tensor, int]:
    if hasattr(model, "rope_positions"):
        return model.rope_positions(ids, images)
    return torch.arange(len(ids)), 0


def _override(rows: list[int], values: torch.Tensor, first: int) -> EmbeddingOverride:
    return EmbeddingOverride(torch.tensor([r - first for r in rows]), values)


@torch.inference_mode()
def _our_logits(model, ids: list[int], images: tuple[ImageInput, ...]) -> torch.Tensor:
    rows = sorted(p for image in images for p in image.positions())
    values = torch.cat(model.encode_images(images))
    positions, _ = _positions(model, ids, images)
    ctx = AttentionContext([SequenceSlice(0, len(ids), len(ids))], None, torch.device("cpu"))
    return model.compute_logits(model(torch.tensor(ids), positions, ctx, _override(rows, values, 0)))


@pytest.mark.parametrize("num_images", [1, 2])
def test_logits_match_transformers(family, num_images: int) -> None:
    _, reference, model, _, _ = family
    ids, images = _prompt(family, num_images)
    assert len(images) == num_images and all(image.num_tokens > 0 for image in images)
    with torch.inference_mode():
        expected = reference(**_reference_inputs(family, ids, images)).logits[0]
    ours = _our_logits(model, ids, images)
    assert (ours - expected).abs().max().item() <= TOL_VS_TRANSFORMERS
    # the images matter: another image moves the logits
    other = _our_logits(model, *_prompt_with(family, num_images, png(7, 90, 90)))
    assert other.shape != ours.shape or (other - ours).abs().max().item() > 1e-3


def _prompt_with(family, num_images: int, image: bytes) -> tuple[list[int], tuple[ImageInput, ...]]:
    _, _, _, prompter, tokenizer = family
    text = "Describe" + "".join(f" {prompter.marker} then" for _ in range(num_images)) + " please."
    return prompter.prepare(tokenizer.encode(text, add_special_tokens=False), (image,) * num_images)


def test_engine_greedy_tokens_and_prefix_cache_match_transformers(family) -> None:
    """Through the real engine (8-token prefill chunks of 4-token blocks, the CPU's decode step and
    prompt tails, two requests batched): greedy tokens equal transformers' `generate`, and again
    with every whole block a prefix-cache hit (M-RoPE positions then start mid-prompt)."""
    _, reference, model, _, _ = family
    prompts = [_prompt(family, 1), _prompt(family, 2)]
    with torch.inference_mode():
        expected = [reference.generate(**_reference_inputs(family, ids, images), max_new_tokens=NUM_TOKENS,
                                       do_sample=False)[0, len(ids):].tolist() for ids, images in prompts]
    client = _engine(model)
    try:
        async def run(tag: str) -> list[tuple[list[int], int]]:
            return list(await asyncio.gather(*(_generate(client, f"{tag}{i}", *p) for i, p in enumerate(prompts))))

        assert [tokens for tokens, _ in asyncio.run(run("a"))] == expected
        again = asyncio.run(run("b"))
        assert [tokens for tokens, _ in again] == expected
        # every whole block hits; the last prompt token is computed again for its logits
        assert [cached for _, cached in again] == [min(len(ids) // 4 * 4, len(ids) - 1) for ids, _ in prompts]
    finally:
        client.core.stop(10)


def test_mrope_table_matches_transformers() -> None:
    """Contiguous (Qwen2.5-VL) and interleaved (Qwen3-VL) sections, against transformers' rotary on
    the same [3, T] positions; one row of positions is the plain rotary."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    positions = torch.stack((torch.arange(12), torch.arange(12) % 4 + 3, torch.arange(12) // 4 + 5))
    for reference_class, config_class, interleaved in (
            (Qwen2_5_VLRotaryEmbedding, transformers.Qwen2_5_VLTextConfig, False),
            (Qwen3VLTextRotaryEmbedding, transformers.Qwen3VLTextConfig, True)):
        rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0,
                "mrope_interleaved": interleaved}
        config = config_class(hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters=rope)
        cos_ref, sin_ref = reference_class(config)(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
        ours = MRotaryEmbedding(16, 10000.0, {"rope_type": "mrope", "mrope_section": [2, 3, 3],
                                              "mrope_interleaved": interleaved})
        cos, sin = ours.cos_sin(positions, torch.float32)
        assert torch.allclose(cos[:, 0], cos_ref[0], atol=1e-6)
        assert torch.allclose(sin[:, 0, 8:], sin_ref[0, :, 8:], atol=1e-6)  # the signed sin's second half
        plain = ours.cos_sin(positions[0], torch.float32)[0]
        assert torch.allclose(ours.cos_sin(positions[:1].expand(3, -1).clone(), torch.float32)[0], plain, atol=1e-6)


def test_prompter_refuses_a_marker_count_that_differs(family) -> None:
    _, _, _, prompter, tokenizer = family
    ids = tokenizer.encode(f"one {prompter.marker} only", add_special_tokens=False)
    with pytest.raises(ValueError):
        prompter.prepare(ids, IMAGES)


def test_qwen2_5_vl_video_logits_match_transformers(tmp_path: Path) -> None:
    """A video of 3 frames (padded to 4: 2 temporal patches) beside an image: transformers' forward on
    the same pixels as `pixel_values_videos`, its grid and seconds per temporal patch (M-RoPE's
    temporal positions step by tokens_per_second * 2 / fps)."""
    reference, _ = write_qwen_vl(tmp_path, "qwen2_5_vl")
    model = load_model(tmp_path).model
    tokenizer = Tokenizer.from_pretrained_dir(tmp_path)
    prompter = model.image_prompter(tmp_path, tokenizer)
    text = f"See {prompter.video_marker} and {prompter.marker} now."
    frames = tuple(png(20 + i, 90, 60) for i in range(3))
    ids, inputs = prompter.prepare_media(tokenizer.encode(text, add_special_tokens=False), [IMAGES[1]], [(frames, 2.0)])
    video, image = inputs
    assert video.pixels["image_grid_thw"].tolist() == [[2, 4, 6]] and video.runs[0][0] < image.runs[0][0]
    video_token = model.vision["video_token_id"]
    with torch.inference_mode():
        expected = reference(
            input_ids=torch.tensor([ids]), pixel_values=image.pixels["pixel_values"],
            image_grid_thw=image.pixels["image_grid_thw"], pixel_values_videos=video.pixels["pixel_values"],
            video_grid_thw=video.pixels["image_grid_thw"], second_per_grid_ts=torch.tensor([1.0]),
            mm_token_type_ids=torch.tensor([[1 if t == model.vision["image_token_id"] else 2 if t == video_token else 0
                                             for t in ids]])).logits[0]
    assert (_our_logits(model, ids, inputs) - expected).abs().max().item() <= TOL_VS_TRANSFORMERS


def test_qwen2_5_vl_loads_the_flat_transformers_4_config(tmp_path: Path) -> None:
    """Most Hub checkpoints keep the text fields at the top level beside vision_config, with M-RoPE as
    rope_scaling {"type": "mrope"}: the same weights give the same logits as the nested form."""
    import json
    import shutil

    nested = tmp_path / "nested"
    write_qwen_vl(nested, "qwen2_5_vl")
    flat = tmp_path / "flat"
    shutil.copytree(nested, flat)
    config = json.loads((nested / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    config = {**text, **config, "rope_theta": rope["rope_theta"],
              "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    (flat / "config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_pretrained_dir(nested)
    logits = []
    for folder in (nested, flat):
        model = load_model(folder).model
        prompter = model.image_prompter(folder, tokenizer)
        ids, images = prompter.prepare(tokenizer.encode(f"a {prompter.marker} b", add_special_tokens=False), IMAGES[:1])
        logits.append(_our_logits(model, ids, images))
    assert torch.equal(logits[0], logits[1])
