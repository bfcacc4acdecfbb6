"""Issue 43 (part B): a tiny Qwen2.5-VL checkpoint transformers writes (with its preprocessor_config.json)
served end to end through the real HTTP server on port 0, with the OpenAI SDK (image_url data URLs).

The expected text is transformers' greedy `generate` on the ids the Qwen2.5-VL processor's expansion gives
(each `<|image_pad|>` repeated once per merged token of the grid transformers' own image processor picks),
with M-RoPE positions from the image grids; the image tokens count in usage, and the same image hits the
prefix cache."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from tokenizers import Tokenizer

from mlxcel.config import EngineConfig
from mlxcel.loading import resolve_model
from mlxcel.serving.chat_model import start_served_model
from mlxcel.serving.served_model import RuntimeOptions
from tests.models.vision_qwen_checkpoints import EOS, png, write_qwen_vl
from tests.server.test_vision_server import data_url

pytestmark = pytest.mark.slow

NUM_TOKENS = 6
QUESTION = "What is this?"
MARKER = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory, start_server) -> Iterator[tuple[str, torch.nn.Module, Path]]:
    folder = tmp_path_factory.mktemp("qwen2_5_vl_server")
    reference, _ = write_qwen_vl(folder, "qwen2_5_vl")
    model = start_served_model(resolve_model(str(folder)), RuntimeOptions(warmup=False, quantize="off"),
                               EngineConfig(max_num_seqs=2, ctx_size=512, decode_step="eager"))
    server = start_server(model)
    yield server.address, reference, folder
    model.close(30)


@torch.inference_mode()
def expected_text(reference: torch.nn.Module, folder: Path, images: list[bytes]) -> tuple[str, int]:
    """transformers' greedy text for `<user>` + one image per line + the question + `<assistant>`, and the
    prompt's token count."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    processed = Qwen2VLImageProcessorPil.from_pretrained(str(folder))(
        images=[Image.open(io.BytesIO(d)).convert("RGB") for d in images], return_tensors="pt")
    pads = [MARKER.replace("<|image_pad|>", "<|image_pad|>" * (int(g.prod()) // 4)) for g in processed["image_grid_thw"]]
    ids = tokenizer.encode("<user>" + "\n".join([*pads, QUESTION]) + "\n<assistant>").ids
    pad = tokenizer.token_to_id("<|image_pad|>")
    out = reference.generate(input_ids=torch.tensor([ids]), pixel_values=processed["pixel_values"],
                             image_grid_thw=processed["image_grid_thw"], max_new_tokens=NUM_TOKENS, do_sample=False,
                             mm_token_type_ids=torch.tensor([[int(t == pad) for t in ids]]))[0, len(ids):].tolist()
    eos = tokenizer.token_to_id(EOS)
    out = out[:out.index(eos)] if eos in out else out
    return tokenizer.decode(out, skip_special_tokens=True), len(ids)


def test_issue43_qwen2_5_vl_openai_sdk_image_url_matches_transformers(vlm) -> None:
    address, reference, folder = vlm
    images = [png(0, 200, 120), png(1, 60, 90)]
    client = openai.OpenAI(base_url=f"{address}/v1", api_key="none", max_retries=0)
    for count in (1, 2):
        text, num_prompt = expected_text(reference, folder, images[:count])
        content = [{"type": "image_url", "image_url": {"url": data_url(d)}} for d in images[:count]]
        messages = [{"role": "user", "content": [*content, {"type": "text", "text": QUESTION}]}]
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=NUM_TOKENS, temperature=0)
        assert text and reply.choices[0].message.content == text
        assert reply.usage.prompt_tokens == num_prompt  # every image pad counts
    again = client.chat.completions.create(model="m", messages=messages, max_tokens=NUM_TOKENS, temperature=0)
    assert again.choices[0].message.content == text
    assert again.usage.prompt_tokens_details.cached_tokens > num_prompt // 2  # the same images: a prefix-cache hit


def test_issue43_qwen2_5_vl_video_url_as_temporal_patches(vlm) -> None:
    """A video_url part (an MP4 data URL, sampled at its own 2 frames a second: 4 frames, 2 temporal
    patches) renders as `<|video_pad|>`s; the reply is transformers' greedy text on the pixels our
    prompter made of the media layer's frames, and usage counts the video's pads."""
    from mlxcel.media.limits import MediaPolicy
    from mlxcel.media.video import decode_video_frames
    from tests.media.video_files import make_video

    address, reference, folder = vlm
    video = make_video(4, rate=2, width=64, height=48)
    frames = []
    for frame in decode_video_frames(video, 2.0, 16, MediaPolicy()):
        buffer = io.BytesIO()
        frame.save(buffer, format="PNG")
        frames.append(buffer.getvalue())
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompter = _prompter(folder)
    prompt = "<user>" + prompter.video_marker + "\n" + QUESTION + "\n<assistant>"
    ids, (clip,) = prompter.prepare_media(tokenizer.encode(prompt).ids, [], [(frames, 2.0)])
    assert clip.pixels["image_grid_thw"][0, 0] == 2
    pad = tokenizer.token_to_id("<|video_pad|>")
    with torch.inference_mode():
        out = reference.generate(
            input_ids=torch.tensor([ids]), pixel_values_videos=clip.pixels["pixel_values"],
            video_grid_thw=clip.pixels["image_grid_thw"], second_per_grid_ts=torch.tensor([1.0]),
            mm_token_type_ids=torch.tensor([[2 * int(t == pad) for t in ids]]), max_new_tokens=NUM_TOKENS,
            do_sample=False)[0, len(ids):].tolist()
    eos = tokenizer.token_to_id(EOS)
    text = tokenizer.decode(out[:out.index(eos)] if eos in out else out, skip_special_tokens=True)
    client = openai.OpenAI(base_url=f"{address}/v1", api_key="none", max_retries=0)
    url = "data:video/mp4;base64," + base64.b64encode(video).decode()
    reply = client.chat.completions.create(model="m", max_tokens=NUM_TOKENS, temperature=0, messages=[{
        "role": "user", "content": [{"type": "video_url", "video_url": {"url": url, "fps": 2}},
                                    {"type": "text", "text": QUESTION}]}])
    assert text and reply.choices[0].message.content == text
    assert reply.usage.prompt_tokens == len(ids)


def _prompter(folder: Path):
    from mlxcel.loading import load_model
    from mlxcel.text.tokenizer import Tokenizer as OurTokenizer

    model = load_model(folder).model
    return model.image_prompter(folder, OurTokenizer.from_pretrained_dir(folder))
