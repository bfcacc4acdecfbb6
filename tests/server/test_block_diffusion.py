"""Spec U: a block-diffusion (DiffusionGemma) checkpoint as -m, through the real `mlxcel-server`
process and loading path, served by its serial worker; the real openai SDK on both routes,
streamed (one delta per committed block) and not, the thinking channel parsed into
`reasoning_content`, the queue's 503 and the deadline's 504, the flags' validation.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.test_single_purpose import SERVER, server_process
from tests.workers.tiny_diffusion import CANVAS_LENGTH, write_tiny_diffusion_gemma

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_diffusion_gemma(tmp_path_factory.mktemp("diffusion") / "tiny-diffusion-gemma")


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[tuple[str, list[str]]]:
    with server_process("-m", str(checkpoint), "--max-denoising-steps", "4", "--metrics",
                        env={"MLXCEL_DIFFUSION_SAMPLER": "confidence", "MLXCEL_DIFFUSION_THRESHOLD": "0.5"}) as running:
        yield running


@pytest.fixture()
def client(server: tuple[str, list[str]]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def test_u_startup_logs_the_block_diffusion_model_and_its_flags(server: tuple[str, list[str]]) -> None:
    log = "".join(server[1])
    assert "block diffusion" in log and "sampler confidence" in log, log


def test_u_chat_parses_the_thinking_channel_into_reasoning_content(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=20, seed=7)
    choice = reply.choices[0]
    reasoning = choice.message.model_extra.get("reasoning_content")
    assert reasoning, reply  # the template opens <think>: a random model's blocks stay reasoning
    assert "<think>" not in reasoning and "</think>" not in (choice.message.content or "")
    assert choice.finish_reason in ("length", "stop")
    assert 0 < reply.usage.completion_tokens <= 20 and reply.usage.prompt_tokens > 0
    again = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=20, seed=7)
    assert again.choices[0].message.model_extra.get("reasoning_content") == reasoning  # the seed fixes the canvas


def test_u_chat_without_thinking_answers_in_content(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=16, seed=3,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = reply.choices[0].message
    assert message.content and not message.model_extra.get("reasoning_content"), reply


def test_u_chat_stream_sends_one_delta_per_committed_block(client: openai.OpenAI) -> None:
    max_tokens = 3 * CANVAS_LENGTH
    whole = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=max_tokens, seed=11,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    stream = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=max_tokens, seed=11,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    chunks = list(stream)
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    usage = [c.usage for c in chunks if c.usage is not None][-1]
    assert "".join(texts) == whole.choices[0].message.content
    blocks = math.ceil(usage.completion_tokens / CANVAS_LENGTH)
    assert 1 <= len(texts) <= blocks, texts  # a block's tokens arrive together, never token by token
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_u_completions_plain_and_streamed(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="m", prompt="Once upon a time", max_tokens=12, seed=5)
    assert whole.choices[0].text and whole.usage.completion_tokens <= 12
    parts = [c.choices[0].text for c in client.completions.create(model="m", prompt="Once upon a time",
                                                                  max_tokens=12, seed=5, stream=True) if c.choices]
    assert "".join(parts) == whole.choices[0].text
    assert len([p for p in parts if p]) <= math.ceil(12 / CANVAS_LENGTH)


def test_u_bad_input_is_a_400_naming_the_field(server: tuple[str, list[str]]) -> None:
    address = server[0]
    bad = httpx.post(address + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": -1})
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
    empty = httpx.post(address + "/v1/chat/completions", json={"messages": "hi"})
    assert empty.status_code == 400 and "messages" in empty.json()["error"]["message"]
    long_prompt = httpx.post(address + "/v1/completions", json={"prompt": "x" * 600, "max_tokens": 4})
    assert long_prompt.status_code == 400 and long_prompt.json()["error"]["type"] == "exceed_context_size_error"


def test_u_health_models_and_metrics_show_the_worker(server: tuple[str, list[str]], client: openai.OpenAI) -> None:
    address = server[0]
    client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8)
    health = httpx.get(address + "/health").json()
    assert health["status"] == "ok"
    assert health["block_diffusion"]["sampler"] == "confidence"
    assert health["block_diffusion"]["canvas_length"] == CANVAS_LENGTH
    models = httpx.get(address + "/v1/models").json()["data"]
    assert models[0]["id"] == "tiny-diffusion-gemma" and "block_diffusion" in models[0]["capabilities"]
    metrics = httpx.get(address + "/metrics").text
    assert "mlxcel_block_diffusion_blocks_total" in metrics
    blocks = [line for line in metrics.splitlines() if line.startswith("mlxcel_block_diffusion_blocks_total")]
    assert float(blocks[0].split()[-1]) >= 1


def test_u_busy_queue_is_503_and_a_late_request_504(checkpoint: Path) -> None:
    # Default denoising (48 steps a block) for 400 tokens runs far past a 3 s deadline: the running
    # request ends with 504, the queued one expires as well, and the third finds the queue full.
    # ignore_eos: the random model must not end a reply early with an end token.
    with server_process("-m", str(checkpoint), "--max-queue-depth", "1", "--diffusion-request-timeout", "3") \
            as (address, _):
        body = {"messages": MESSAGES, "max_tokens": 400, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, address + "/v1/chat/completions", json=body, timeout=60)
            _wait_for_running(address)
            second = pool.submit(httpx.post, address + "/v1/chat/completions", json=body, timeout=60)
            _wait_for_queued(address)
            third = httpx.post(address + "/v1/chat/completions", json=body, timeout=60)
            assert third.status_code == 503, third.text
            assert "queue is full" in third.json()["error"]["message"] and third.headers.get("Retry-After")
            for response in (first.result(), second.result()):
                assert response.status_code == 504, response.text
                error = response.json()["error"]
                assert error["type"] == "timeout_error" and "--diffusion-request-timeout" in error["message"]
        health = httpx.get(address + "/health").json()
        assert health["block_diffusion"]["requests_timed_out"] == 2


def _wait_for_running(address: str) -> None:
    from tests.server.conftest import wait_until

    wait_until(lambda: httpx.get(address + "/health").json()["batch"]["active_sequences"] == 1, what="a running request")


def _wait_for_queued(address: str) -> None:
    from tests.server.conftest import wait_until

    wait_until(lambda: httpx.get(address + "/health").json()["block_diffusion"]["queue_depth"] == 1,
               what="a queued request")


@pytest.mark.parametrize(("args", "named"), [
    (["--diffusion-sampler", "greedy"], "--diffusion-sampler"),
    (["--max-denoising-steps", "-1"], "--max-denoising-steps"),
    (["--diffusion-threshold", "0"], "--diffusion-threshold"),
])
def test_u_bad_flag_values_refuse_startup_naming_the_flag(args: list[str], named: str) -> None:
    result = subprocess.run([sys.executable, "-c", SERVER, "--port", "0", *args], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and named in result.stderr, result.stderr


def test_u_confidence_threshold_past_one_refuses_startup(checkpoint: Path) -> None:
    env = {**os.environ, "MLXCEL_DIFFUSION_SAMPLER": "confidence"}
    result = subprocess.run([sys.executable, "-c", SERVER, "--port", "0", "-m", str(checkpoint),
                             "--diffusion-threshold", "1.5"], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0 and "--diffusion-threshold" in result.stderr, result.stderr


def test_u_help_lists_the_diffusion_flags() -> None:
    result = subprocess.run([sys.executable, "-c", SERVER, "--help"], capture_output=True, text=True, timeout=120)
    for flag in ("--diffusion-sampler", "--diffusion-threshold", "--max-denoising-steps",
                 "--diffusion-request-timeout", "MLXCEL_DIFFUSION_SAMPLER"):
        assert flag in result.stdout, flag


def _png(width: int, height: int, color: tuple[int, int, int]) -> str:
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_u_image_url_parts_reach_the_vision_tower(client: openai.OpenAI, checkpoint: Path) -> None:
    from PIL import Image
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    soft = Gemma4ImageProcessorPil.from_pretrained(checkpoint)(images=[Image.new("RGB", (32, 24))], return_tensors="pt")

    def ask(color: tuple[int, int, int]) -> openai.types.chat.ChatCompletion:
        content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": _png(32, 24, color)}}]
        return client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}],
                                              max_tokens=3 * CANVAS_LENGTH, seed=2)

    red, blue = ask((255, 0, 0)), ask((0, 0, 255))
    text_only = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "What is this?"}],
                                               max_tokens=3 * CANVAS_LENGTH, seed=2)
    # the image's soft tokens (between begin and end of image, for its marker) are in the prompt the
    # model saw and the usage counts
    num_soft = int(soft["num_soft_tokens_per_image"][0])
    assert red.usage.prompt_tokens >= text_only.usage.prompt_tokens + num_soft + 1, (red.usage, text_only.usage)
    assert red.choices[0].message.model_extra.get("reasoning_content") != \
        blue.choices[0].message.model_extra.get("reasoning_content")  # the pixels change the reply


def test_u_image_refusals_are_400s(server: tuple[str, list[str]]) -> None:
    address = server[0]
    audio = [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]
    bad_audio = httpx.post(address + "/v1/chat/completions", json={"messages": [{"role": "user", "content": audio}]})
    assert bad_audio.status_code == 400, bad_audio.text
    broken = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    bad_image = httpx.post(address + "/v1/chat/completions", json={"messages": [{"role": "user", "content": broken}]})
    assert bad_image.status_code == 400 and bad_image.json()["error"]["code"], bad_image.text
    image = [{"type": "image_url", "image_url": {"url": _png(8, 8, (0, 255, 0))}}]
    # issue 43: the Responses API takes `input_image` wherever chat takes `image_url` (before: a 400 here)
    responses = httpx.post(address + "/v1/responses", json={"max_output_tokens": 8, "input": [{"role": "user",
                           "content": [{"type": "input_image", "image_url": _png(8, 8, (0, 255, 0))}]}]}, timeout=60)
    assert responses.status_code == 200 and responses.json()["object"] == "response", responses.text
    assert image  # the same image is served on /v1/chat/completions (test above)


def test_u_a_closed_stream_aborts_its_denoising_and_slot_routes_answer(server: tuple[str, list[str]]) -> None:
    address = server[0]
    before = httpx.get(address + "/health").json()["observability"]["sequences_aborted"]
    body = {"messages": MESSAGES, "max_tokens": 480, "stream": True}
    with httpx.stream("POST", address + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first block arrived; leave
    from tests.server.conftest import wait_until

    wait_until(lambda: httpx.get(address + "/health").json()["observability"]["sequences_aborted"] == before + 1,
               what="the abandoned request aborted")
    assert httpx.get(address + "/health").json()["batch"]["active_sequences"] == 0
    erase = httpx.post(address + "/slots/0?action=erase")
    assert erase.status_code == 400 and "block-diffusion" in erase.json()["error"]["message"], erase.text
    reset = httpx.post(address + "/v1/cache/reset")
    assert reset.status_code == 200 and reset.json()["reset"] is False, reset.text
