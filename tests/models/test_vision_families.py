"""Issue 43: vision-language families from tiny random checkpoints transformers writes.

For one and two images our logits equal transformers' float32 forward on the same token ids and
pixels (the family's own processor settings, read from the checkpoint), and through the real engine
(paged KV, prompts in chunks, continuous batching) the greedy tokens equal transformers'. The prefix
cache keys blocks by image content: the same image and text hit, another image with the same text
misses from the first block its placeholders touch.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from mlxcel.config import EngineConfig
from mlxcel.engine.client import EngineClient
from mlxcel.engine.loop import EngineCore, ModelShape
from mlxcel.layers.attention import AttentionContext, SequenceSlice
from mlxcel.layers.decoder import EmbeddingOverride
from mlxcel.loading import load_model
from mlxcel.text.tokenizer import Tokenizer
from mlxcel.types import ImageCacheKeys, ImageInput, Request, SamplingParams

from .vision_checkpoints import png, write_gemma3_vlm, write_idefics3_vlm, write_llava_next_vlm, write_llava_vlm

TOL_VS_TRANSFORMERS = 2e-5
NUM_TOKENS = 4


@dataclass(frozen=True)
class Family:
    write: Callable[[Path], tuple[torch.nn.Module, dict[str, int]]]
    marker: str  # the token an image part renders as
    image_token: str  # the placeholder the encoder's rows replace
    tokens_per_image: int  # for the 40 x 30 test images

    def reference_inputs(self, ids: list[int], images: tuple[ImageInput, ...], image_token: int) -> dict[str, Any]:
        """transformers' forward arguments for these images (how its own processor lays them out)."""
        pixels = torch.cat([image.pixels["pixel_values"] for image in images])
        if self is FAMILIES["gemma3"]:
            return {"pixel_values": pixels, "token_type_ids": torch.tensor([[int(t == image_token) for t in ids]])}
        if self is FAMILIES["idefics3"]:
            return {"pixel_values": pixels[None]}  # [batch, tiles, 3, H, W]
        if self is FAMILIES["llava_next"]:  # [images, tiles, 3, H, W] (the same tile count: same-sized images)
            return {"pixel_values": torch.stack([image.pixels["pixel_values"] for image in images]),
                    "image_sizes": torch.stack([image.pixels["image_sizes"] for image in images])}
        return {"pixel_values": pixels}


FAMILIES = {
    "gemma3": Family(write_gemma3_vlm, "<start_of_image>", "<image_soft_token>", 4),
    "idefics3": Family(write_idefics3_vlm, "<image>", "<image>", 5 * 16),  # 2 x 2 tiles and the global image
    "llava": Family(write_llava_vlm, "<image>", "<image>", 16),
    # a 1 x 2 grid of 4 x 4 features, unpadded to 4 x 6 with a newline a row, after the 16 of the base tile
    "llava_next": Family(write_llava_next_vlm, "<image>", "<image>", 16 + 4 * (6 + 1)),
}


FOLDERS: dict[str, Path] = {}  # each family's checkpoint folder, once its fixture wrote it


@pytest.fixture(scope="module", params=list(FAMILIES))
def vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    family = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    FOLDERS[request.param] = folder
    reference, ids = family.write(folder)
    model = load_model(folder).model
    prompter = model.image_prompter(folder, Tokenizer.from_pretrained_dir(folder))
    return family, reference, model, prompter, ids


def _prompt(family: Family, tokenizer_ids: dict[str, int], num_images: int) -> list[int]:
    marker = tokenizer_ids[family.marker]
    text = [ord(c) % 200 + 20 for c in "Describe"]
    ids = list(text)
    for i in range(num_images):
        ids += [marker] + [40 + i, 41]
    return ids + [ord(c) % 200 + 20 for c in " it please"]


@torch.inference_mode()
def _reference_logits(family: Family, reference: torch.nn.Module, ids: list[int], images: tuple[ImageInput, ...],
                      image_token: int) -> torch.Tensor:
    inputs = family.reference_inputs(ids, images, image_token)
    return reference(input_ids=torch.tensor([ids]), **inputs).logits[0]


@torch.inference_mode()
def _our_logits(model: torch.nn.Module, ids: list[int], images: tuple[ImageInput, ...]) -> torch.Tensor:
    spans = tuple((a, a + n) for image in images if image.is_bidirectional for a, n in image.runs)
    ctx = AttentionContext([SequenceSlice(0, len(ids), len(ids), bidirectional=spans)], None, "cpu")
    positions = torch.tensor([p for image in images for p in image.positions()])
    embeds = EmbeddingOverride(positions, torch.cat(model.encode_images(images)))
    return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), ctx, embeds))


@pytest.mark.parametrize("num_images", [1, 2])
def test_issue43_vlm_logits_equal_transformers(vlm, num_images: int) -> None:
    family, reference, model, prompter, ids = vlm
    token_ids, images = prompter.prepare(_prompt(family, ids, num_images), [png(i) for i in range(num_images)])
    image_token = ids[family.image_token]
    assert sum(t == image_token for t in token_ids) == family.tokens_per_image * num_images
    assert [image.num_tokens for image in images] == [family.tokens_per_image] * num_images
    ours = _our_logits(model, token_ids, images)
    expected = _reference_logits(family, reference, token_ids, images, image_token)
    assert (ours - expected).abs().max() <= TOL_VS_TRANSFORMERS
    # the image matters: another image gives other logits after the placeholders
    _, others = prompter.prepare(_prompt(family, ids, num_images), [png(10 + i) for i in range(num_images)])
    assert (_our_logits(model, token_ids, others)[-1] - ours[-1]).abs().max() > 1e-3


@torch.inference_mode()
def _reference_greedy(family: Family, reference: torch.nn.Module, ids: list[int], images: tuple[ImageInput, ...],
                      image_token: int) -> list[int]:
    ids = list(ids)
    for _ in range(NUM_TOKENS):
        ids.append(int(_reference_logits(family, reference, ids, images, image_token)[-1].argmax()))
    return ids[-NUM_TOKENS:]


def _engine(model: torch.nn.Module, **overrides: Any) -> EngineClient:
    # 8-token prefill chunks of 4-token blocks: prompts come in several chunks; a soft-token run is never split
    config = EngineConfig(**{"max_num_seqs": 4, "ctx_size": 4 * 256, "max_num_batched_tokens": 8, "block_size": 4,
                             "cache_type_k": "f32", "cache_type_v": "f32", **overrides})
    core = EngineCore(model, ModelShape.of(model.args), config, eos_token_ids=frozenset(),
                      cache_identity="vision-test" if config.prefix_cache_dir else "")
    core.start()
    return EngineClient(core)


async def _generate(client: EngineClient, request_id: str, ids: list[int],
                    images: tuple[ImageInput, ...], slot_id: int | None = None) -> tuple[list[int], int]:
    tokens, cached = [], 0
    sampling = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    request = Request(request_id, list(ids), sampling, slot_id=slot_id, image_inputs=images)
    async for event in client.generate(request):
        tokens.extend(event.token_ids)
        cached = event.num_cached_tokens or cached
    return tokens, cached


def test_issue43_vlm_engine_greedy_and_image_aware_prefix_cache(vlm) -> None:
    family, reference, model, prompter, ids = vlm
    image_token = ids[family.image_token]
    one = prompter.prepare(_prompt(family, ids, 1), [png(0)])
    two = prompter.prepare(_prompt(family, ids, 2), [png(1), png(2)])
    other = prompter.prepare(_prompt(family, ids, 1), [png(3)])
    assert one[0] == other[0]  # the same token ids: only the pixels differ
    expected = [_reference_greedy(family, reference, *p, image_token) for p in (one, two, other)]
    client = _engine(model)
    try:
        async def run(tag: str) -> list[tuple[list[int], int]]:
            return list(await asyncio.gather(*(_generate(client, f"{tag}{i}", *p) for i, p in enumerate((one, two)))))

        first = asyncio.run(run("a"))
        assert [tokens for tokens, _ in first] == expected[:2]
        again = asyncio.run(run("b"))  # same images and text: every full block is a hit
        assert [tokens for tokens, _ in again] == expected[:2]
        assert [cached for _, cached in again] == [min(len(p[0]) // 4 * 4, len(p[0]) - 1) for p in (one, two)]
        tokens, cached = asyncio.run(_generate(client, "c", *other))  # another image, the same text
        assert tokens == expected[2]
        assert cached == one[1][0].runs[0][0] // 4 * 4  # hits stop at the block of the first soft token
    finally:
        client.core.stop(10)


def test_issue43_slot_restore_keys_blocks_by_their_images_also_after_a_restart(vlm, tmp_path: Path) -> None:
    """A saved slot's image blocks come back keyed by the image: after a restore the same image and text hit
    every block, another image (or no image) with the same tokens hits only the blocks before the image; the
    same holds for the restored blocks read back from the disk tier by a restarted engine."""
    family, reference, model, prompter, ids = vlm
    if family is not FAMILIES["gemma3"]:
        pytest.skip("one family is enough: the slot file's keys do not depend on the family")
    image_token = ids[family.image_token]
    one = prompter.prepare(_prompt(family, ids, 1), [png(0)])
    other = prompter.prepare(_prompt(family, ids, 1), [png(3)])
    third = prompter.prepare(_prompt(family, ids, 1), [png(4)])
    full, before_image = (len(one[0]) - 1) // 4 * 4, one[1][0].runs[0][0] // 4 * 4
    slots, disk = {"slot_save_path": str(tmp_path / "slots")}, {"prefix_cache_dir": str(tmp_path / "disk"),
                                                                  "prefix_cache_disk_bytes": 2**26}
    client = _engine(model, **slots)
    try:
        asyncio.run(_generate(client, "a", *one, slot_id=1))
        saved = asyncio.run(client.save_slot(1, "image.bin"))
        assert saved.num_tokens >= full  # every full block, the image's included (and generated tokens)
    finally:
        client.core.stop(10)
    client = _engine(model, **slots, **disk)
    try:
        assert asyncio.run(client.restore_slot(0, "image.bin")).num_tokens == saved.num_tokens
        assert asyncio.run(_generate(client, "b", *other)) == (_reference_greedy(family, reference, *other,
                                                                                 image_token), before_image)
        assert asyncio.run(_generate(client, "c", one[0], ()))[1] == before_image  # the tokens without the image
        assert asyncio.run(_generate(client, "d", *one)) == (_reference_greedy(family, reference, *one,
                                                                               image_token), full)
    finally:
        client.core.stop(10)  # the disk tier keeps every cached block, the restored ones included
    client = _engine(model, **disk)
    try:
        assert asyncio.run(_generate(client, "e", *third))[1] == before_image
        assert asyncio.run(_generate(client, "f", *one))[1] == full
    finally:
        client.core.stop(10)


@torch.inference_mode()
def test_issue43_llava_next_anyres_equals_transformers_processor_and_model(vlm) -> None:
    """LLaVA-NeXT with a wide and a tall image (unpadding cuts rows from one, columns from the other): our
    expansion equals LlavaNextProcessor's input_ids and our logits transformers' forward on its pixels."""
    family, reference, model, prompter, ids = vlm
    if family is not FAMILIES["llava_next"]:
        pytest.skip("llava_next only")
    from PIL import Image
    from tokenizers import Tokenizer
    from transformers import LlavaNextProcessor, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(FOLDERS["llava_next"] /
                                                                                  "tokenizer.json")))
    processor = LlavaNextProcessor(image_processor=prompter.processor, tokenizer=tokenizer, patch_size=4,
                                   vision_feature_select_strategy="default", image_token="<image>",
                                   num_additional_image_tokens=1)  # the CLIP class token, as hub checkpoints say
    images = [png(20, 80, 20), png(21, 16, 64)]  # 1 x 2 tiles, 4 x 8 features cut to 2 rows; 2 x 1, to 2 columns
    text = "Look <image> and <image> now"
    inputs = processor(text=text, images=[Image.open(io.BytesIO(d)).convert("RGB") for d in images], return_tensors="pt")
    token_ids, ours = prompter.prepare(tokenizer.encode(text), images)
    assert token_ids == inputs["input_ids"][0].tolist()
    assert [image.num_tokens for image in ours] == [16 + 2 * (8 + 1), 16 + 8 * (2 + 1)]  # both cuts happen
    expected = reference(**inputs).logits[0]
    assert (_our_logits(model, token_ids, ours) - expected).abs().max() <= TOL_VS_TRANSFORMERS


def test_issue43_image_cache_keys_differ_only_where_an_image_lies() -> None:
    first = ImageCacheKeys.of(None, (ImageInput("aa", ((5, 4),), {}),))
    second = ImageCacheKeys.of(None, (ImageInput("bb", ((5, 4),), {}),))
    assert first.for_block(0, 4) == second.for_block(0, 4) is None  # before the image: plain text keys
    assert first.for_block(4, 8) != second.for_block(4, 8)
    assert first.for_block(8, 12) == (None, ("images", ("aa",)))
    assert first.for_block(12, 16) is None  # after it: the chain hash carries the image
