"""Issue 43: a vision-language model served end to end: a tiny Gemma 3 checkpoint transformers writes (with its
preprocessor_config.json), through the real HTTP server on port 0 with the OpenAI SDK (an image_url data URL),
the Anthropic SDK (a base64 image block) and the Responses API (input_image).

The expected text is transformers' greedy continuation of the ids Gemma3Processor's expansion gives (the
marker text replaced by the full image sequence, then tokenized), with transformers' own image processor's
pixels. Also: image tokens count in usage, the same image hits the prefix cache and another does not, an
over-long prompt is a 400, hostile images are 400s and the engine keeps serving."""

from __future__ import annotations

import base64
import io
import zlib
from collections.abc import Iterator
from pathlib import Path
from struct import pack

import anthropic
import httpx
import openai
import pytest
import torch
from tokenizers import Tokenizer

from mlxcel.config import EngineConfig
from mlxcel.loading import resolve_model
from mlxcel.serving.chat_model import start_served_model
from mlxcel.serving.served_model import RuntimeOptions
from mlxcel.text.chat_template import ChatTemplate
from tests.models.vision_checkpoints import EOS, TEMPLATE, png, write_gemma3_vlm

pytestmark = pytest.mark.slow

NUM_TOKENS = 6
QUESTION = "What is this?"
MARKER = "<start_of_image>"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory, start_server) -> Iterator[tuple[str, torch.nn.Module, Path]]:
    folder = tmp_path_factory.mktemp("gemma3_vlm_server")
    reference, _ = write_gemma3_vlm(folder)
    model = start_served_model(resolve_model(str(folder)), RuntimeOptions(warmup=False, quantize="off"),
                               EngineConfig(max_num_seqs=2, ctx_size=512, decode_step="eager"))
    server = start_server(model)
    yield server.address, reference, folder
    model.close(30)


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def expected_text(reference: torch.nn.Module, folder: Path, images: list[bytes], text_after: str) -> tuple[str, int]:
    """transformers' greedy text for `<user>` + one marker per image + `text_after` + `<assistant>`, and the
    prompt's token count."""
    return expected_for(reference, folder, "<user>" + "\n".join([MARKER] * len(images) + [text_after]) + "\n<assistant>",
                        images)


def render(messages: list[dict]) -> str:
    """The test checkpoint's template over chat messages (tool calls as the template polyfill writes them)."""
    return ChatTemplate(TEMPLATE).render(messages)


@torch.inference_mode()
def expected_for(reference: torch.nn.Module, folder: Path, rendered: str, images: list[bytes]) -> tuple[str, int]:
    """transformers' greedy text for the template's text `rendered` with each image marker expanded as
    Gemma3Processor expands it, and the prompt's token count."""
    from PIL import Image
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    sequence = "\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n"  # Gemma3Processor's
    assert rendered.count(MARKER) == len(images)
    ids = tokenizer.encode(rendered.replace(MARKER, sequence)).ids
    pixels = Gemma3ImageProcessorPil.from_pretrained(str(folder))(
        images=[Image.open(io.BytesIO(d)).convert("RGB") for d in images], return_tensors="pt")["pixel_values"]
    soft, eos = tokenizer.token_to_id("<image_soft_token>"), tokenizer.token_to_id(EOS)
    generated: list[int] = []
    for _ in range(NUM_TOKENS):
        full = ids + generated
        token_type = torch.tensor([[int(t == soft) for t in full]])
        logits = reference(input_ids=torch.tensor([full]), pixel_values=pixels, token_type_ids=token_type).logits
        generated.append(int(logits[0, -1].argmax()))
        if generated[-1] == eos:
            generated.pop()
            break
    return tokenizer.decode(generated, skip_special_tokens=True), len(ids)


def test_issue43_openai_sdk_image_url_matches_transformers_and_counts_image_tokens(vlm) -> None:
    address, reference, folder = vlm
    image = png(0)
    text, num_prompt = expected_text(reference, folder, [image], QUESTION)
    client = openai.OpenAI(base_url=f"{address}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                             {"type": "text", "text": QUESTION}]}]
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=NUM_TOKENS, temperature=0)
    assert reply.choices[0].message.content == text
    assert reply.usage.prompt_tokens == num_prompt  # the 4 soft tokens and their markup count
    again = client.chat.completions.create(model="m", messages=messages, max_tokens=NUM_TOKENS, temperature=0)
    assert again.choices[0].message.content == text
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the same image and text: a prefix-cache hit
    other_text, _ = expected_text(reference, folder, [png(5)], QUESTION)
    messages[0]["content"][0]["image_url"]["url"] = data_url(png(5))
    other = client.chat.completions.create(model="m", messages=messages, max_tokens=NUM_TOKENS, temperature=0)
    assert other.choices[0].message.content == other_text
    # another image: hits stop before the first soft token (at "<user>\n\n<start_of_image>", 9 tokens)
    assert (other.usage.prompt_tokens_details.cached_tokens or 0) <= 8


def test_issue43_an_image_request_through_the_engine_process_equals_the_one_process_server(vlm, start_server) -> None:
    """--engine-process on: the prompter comes from the engine process, the processed pixels go to it with the
    request, and the greedy text and usage equal the one-process server's (and transformers')."""
    address, reference, folder = vlm
    image = png(6)
    text, num_prompt = expected_text(reference, folder, [image], QUESTION)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                             {"type": "text", "text": QUESTION}]}]
    split = start_served_model(resolve_model(str(folder)), RuntimeOptions(warmup=False, quantize="off",
                                                                          engine_process="on"),
                               EngineConfig(max_num_seqs=2, ctx_size=512, decode_step="eager"))
    try:
        assert split.image_marker == "<start_of_image>"
        server = start_server(split)
        replies = []
        for base in (address, server.address):
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
            replies.append(client.chat.completions.create(model="m", messages=messages, max_tokens=NUM_TOKENS,
                                                          temperature=0))
        assert [r.choices[0].message.content for r in replies] == [text, text]
        assert [r.usage.prompt_tokens for r in replies] == [num_prompt, num_prompt]
    finally:
        split.close(30)


def test_issue43_two_images_in_one_message(vlm) -> None:
    address, reference, folder = vlm
    images = [png(1), png(2, 20, 50)]
    text, num_prompt = expected_text(reference, folder, images, QUESTION)
    client = openai.OpenAI(base_url=f"{address}/v1", api_key="none", max_retries=0)
    content = [{"type": "image_url", "image_url": {"url": data_url(d)}} for d in images]
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": [*content, {"type": "text", "text": QUESTION}]}],
        max_tokens=NUM_TOKENS, temperature=0)
    assert reply.choices[0].message.content == text and reply.usage.prompt_tokens == num_prompt


def test_issue43_anthropic_sdk_base64_image_block(vlm) -> None:
    address, reference, folder = vlm
    image = png(3)
    text, num_prompt = expected_text(reference, folder, [image], QUESTION)
    with anthropic.Anthropic(base_url=address, api_key="unused", max_retries=0, timeout=120) as sdk:
        reply = sdk.messages.create(model="m", max_tokens=NUM_TOKENS, extra_body={"temperature": 0}, messages=[{
            "role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(image).decode()}},
                {"type": "text", "text": QUESTION}]}])
    assert "".join(block.text for block in reply.content if block.type == "text") == text
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == num_prompt


def test_issue43_responses_input_image(vlm) -> None:
    address, reference, folder = vlm
    image = png(4)
    text, num_prompt = expected_text(reference, folder, [image], QUESTION)
    client = openai.OpenAI(base_url=f"{address}/v1", api_key="none", max_retries=0)
    reply = client.responses.create(model="m", max_output_tokens=NUM_TOKENS, temperature=0, input=[{
        "role": "user", "content": [{"type": "input_image", "image_url": data_url(image)},
                                    {"type": "input_text", "text": QUESTION}]}])
    assert reply.output_text == text and reply.usage.input_tokens == num_prompt


def test_issue43_anthropic_images_inside_a_tool_result_reach_the_model(vlm) -> None:
    """An image block inside a tool_result renders as the marker in the tool turn, after the earlier turn's
    image: both images reach the model in prompt order."""
    address, reference, folder = vlm
    first, second = png(7), png(8)
    call = {"id": "t1", "type": "function", "function": {"name": "camera", "arguments": {}}}
    rendered = render([{"role": "user", "content": f"{MARKER}\nLook."},
                       {"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "t1", "content": f"{MARKER}\nsnapshot"},
                       {"role": "user", "content": "Compare."}])
    text, num_prompt = expected_for(reference, folder, rendered, [first, second])

    def image(data: bytes) -> dict:
        return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(data).decode()}}

    with anthropic.Anthropic(base_url=address, api_key="unused", max_retries=0, timeout=120) as sdk:
        reply = sdk.messages.create(model="m", max_tokens=NUM_TOKENS, extra_body={"temperature": 0}, messages=[
            {"role": "user", "content": [image(first), {"type": "text", "text": "Look."}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "camera", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1",
                 "content": [image(second), {"type": "text", "text": "snapshot"}]},
                {"type": "text", "text": "Compare."}]}])
    assert "".join(block.text for block in reply.content if block.type == "text") == text
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == num_prompt


def test_issue43_responses_history_images_and_function_call_output_images(vlm) -> None:
    """Responses: an earlier turn's input_image (through previous_response_id) and an input_image inside a
    function_call_output both reach the model, in prompt order."""
    address, reference, folder = vlm
    first, second = png(9), png(10)
    client = openai.OpenAI(base_url=f"{address}/v1", api_key="none", max_retries=0)
    turn1 = client.responses.create(model="m", max_output_tokens=NUM_TOKENS, temperature=0, store=True, input=[{
        "role": "user", "content": [{"type": "input_image", "image_url": data_url(first)},
                                    {"type": "input_text", "text": "Look."}]}])
    turn2 = client.responses.create(
        model="m", max_output_tokens=NUM_TOKENS, temperature=0, previous_response_id=turn1.id, input=[
            {"role": "user", "content": "Check."},
            {"type": "function_call", "call_id": "c1", "name": "camera", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [
                {"type": "input_image", "image_url": data_url(second)}, {"type": "input_text", "text": "snap"}]}])
    call = {"id": "c1", "type": "function", "function": {"name": "camera", "arguments": "{}"}}
    rendered = render([{"role": "user", "content": f"{MARKER}\nLook."},
                       {"role": "assistant", "content": turn1.output_text}, {"role": "user", "content": "Check."},
                       {"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "c1", "content": f"{MARKER}\nsnap"}])
    text, num_prompt = expected_for(reference, folder, rendered, [first, second])
    assert turn2.output_text == text and turn2.usage.input_tokens == num_prompt


def test_issue43_a_video_reaches_the_model_as_its_sampled_frames(vlm) -> None:
    """A video_url part: its frames (--video-fps 2, at most --video-max-frames) as images, one marker each."""
    from tests.media.video_files import make_video

    from mlxcel.media.video import decode_video_frames
    from mlxcel.media.limits import MediaPolicy

    address, reference, folder = vlm
    video = make_video(num_frames=20, rate=10)  # 2 s
    frames = decode_video_frames(video, 2.0, 16, MediaPolicy())
    pngs = []
    for frame in frames:
        buffer = io.BytesIO()
        frame.save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    text, num_prompt = expected_text(reference, folder, pngs, QUESTION)
    client = openai.OpenAI(base_url=f"{address}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model="m", max_tokens=NUM_TOKENS, temperature=0, messages=[{
        "role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(video).decode()}},
            {"type": "text", "text": QUESTION}]}])
    assert len(frames) == 4 and reply.usage.prompt_tokens == num_prompt
    assert reply.choices[0].message.content == text


def test_issue43_models_and_props_say_the_model_takes_images(vlm) -> None:
    address, _, _ = vlm
    with httpx.Client(base_url=address, timeout=60) as http:
        assert "multimodal" in http.get("/v1/models").json()["data"][0]["capabilities"]
        assert http.get("/props").json()["modalities"]["vision"] is True


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return pack(">I", len(body)) + kind + body + pack(">I", zlib.crc32(kind + body))


def _bomb() -> bytes:
    """A 60,000 x 60,000 PNG header (3.6 G pixels) over a few bytes of data."""
    header = pack(">IIBBBBB", 60_000, 60_000, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", zlib.compress(b"\0" * 1000)) \
        + _png_chunk(b"IEND", b"")


def _animated_gif(num_frames: int) -> bytes:
    from PIL import Image

    frames = [Image.new("P", (2, 2), 0) for _ in range(num_frames)]
    for i, frame in enumerate(frames):  # distinct frames: Pillow merges identical ones
        frame.putpixel((i % 2, (i // 2) % 2), 1 + i % 200)
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=10)
    return buffer.getvalue()


def _wide() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (100_000, 1)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("kind", ["bomb", "truncated", "gif_10000_frames", "1x100000"])
def test_issue43_hostile_images_are_400_and_the_engine_keeps_serving(vlm, kind: str) -> None:
    address, _, _ = vlm
    data = {"bomb": _bomb, "truncated": lambda: png(6)[:200], "gif_10000_frames": lambda: _animated_gif(10_000),
            "1x100000": _wide}[kind]()
    client = openai.OpenAI(base_url=f"{address}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(data)}}, {"type": "text", "text": "hi"}]}])
    ok = client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png(7))}}, {"type": "text", "text": "hi"}]}])
    assert ok.usage.completion_tokens >= 1


def test_issue43_an_over_long_image_prompt_is_a_400_before_any_work(vlm) -> None:
    address, _, _ = vlm
    client = openai.OpenAI(base_url=f"{address}/v1", api_key="none", max_retries=0)
    content = [{"type": "image_url", "image_url": {"url": data_url(png(i))}} for i in range(30)]  # 30 x 14 tokens
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": content}])
    assert "context" in str(error.value).lower()
