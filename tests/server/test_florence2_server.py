"""Florence-2 through the real server (spec T): `mlxcel-server -m DIR` on a tiny random Florence-2
checkpoint of the real architecture, asked with the real openai SDK.

The process is found to be Florence-2 by the startup path and served by its single-stream worker:
the answer equals transformers' own greedy run, streaming sends it as one delta, the task and the
image are checked at the request boundary (the media layer's limits included), and the worker's
queue bound (--max-queue-depth) and deadline (--decode-timeout) answer 503 and 504.
"""

from __future__ import annotations

import base64
import io
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from tests.server.test_single_purpose import server_process
from tests.workers.test_florence2_provider import REGION, reference
from tests.workers.tiny_florence2 import DECODER_WINDOW, write_tiny_florence2

pytestmark = pytest.mark.slow

IMAGE = Image.new("RGB", (64, 48), (200, 30, 10))


def data_url(image: Image.Image = IMAGE) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def bomb_png(width: int = 10_000, height: int = 10_000) -> str:
    """A 1x1 PNG whose header claims `width` x `height` (100 M pixels, a few dozen bytes)."""
    buffer = io.BytesIO()
    Image.new("L", (1, 1)).save(buffer, "PNG")
    data = bytearray(buffer.getvalue())
    data[16:24] = struct.pack(">II", width, height)  # IHDR's width and height
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))  # IHDR's CRC over type and fields
    return "data:image/png;base64," + base64.b64encode(bytes(data)).decode()


def user(text: str, *images: str) -> list[dict[str, object]]:
    parts: list[dict[str, object]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in images]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def florence2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_florence2(tmp_path_factory.mktemp("florence2"))


@pytest.fixture(scope="module")
def address(florence2_dir: Path) -> Iterator[str]:
    # --max-queue-depth 0: nothing waits behind the running request (the 503 test)
    with server_process("-m", str(florence2_dir), "--max-queue-depth", "0", "--metrics") as (address, log):
        assert any("Florence-2 process" in line for line in log)
        yield address


@pytest.fixture()
def client(address: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{address}/v1", api_key="unused", max_retries=0)


def post(address: str, messages: object, **fields: object) -> httpx.Response:
    return httpx.post(f"{address}/v1/chat/completions", json={"messages": messages, **fields}, timeout=120)


# ---- answers ----

@pytest.mark.parametrize("prompt", ["<OD>", "<CAPTION>", "<OPEN_VOCABULARY_DETECTION>a red car",
                                    f"<REGION_TO_CATEGORY>{REGION}"])
def test_answer_through_the_openai_sdk_is_transformers_own(client: openai.OpenAI, florence2_dir: Path,
                                                           prompt: str) -> None:
    reply = client.chat.completions.create(model="florence", messages=user(prompt, data_url()),  # type: ignore
                                           max_tokens=16)
    want, output, prompt_len = reference(florence2_dir, prompt, IMAGE, 16)
    message = reply.choices[0].message
    result = message.model_extra["florence2_result"]  # type: ignore[index]
    assert result == want
    task = prompt[:prompt.index(">") + 1]
    assert message.content == want[task] if isinstance(want[task], str) else message.content.startswith("{")
    assert reply.choices[0].finish_reason == "length"  # a random model never ends on its own in 16 tokens
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens == prompt_len  # the fused encoder length (17 image tokens +)
    assert usage.completion_tokens == len(output) - 1 == 16


def test_sampling_fields_and_response_format_are_ignored(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model="f", messages=user("<OD>", data_url()), max_tokens=8)  # type: ignore
    sampled = client.chat.completions.create(
        model="f", messages=user("<OD>", data_url()), max_tokens=8, temperature=1.7, top_p=0.3, seed=7,  # type: ignore
        presence_penalty=1.0, response_format={"type": "json_object"}, n=2, extra_body={"top_k": 3})
    assert [c.message.content for c in sampled.choices] == [plain.choices[0].message.content] * 2


def test_stream_sends_the_whole_answer_as_one_delta(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="f", messages=user("<OD>", data_url()), max_tokens=10)  # type: ignore
    chunks = list(client.chat.completions.create(model="f", messages=user("<OD>", data_url()),  # type: ignore
                                                 max_tokens=10, stream=True, stream_options={"include_usage": True}))
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert content == [whole.choices[0].message.content]
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.model_extra["florence2_result"] == (  # type: ignore[index]
        whole.choices[0].message.model_extra["florence2_result"])  # type: ignore[index]
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None, "length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens  # type: ignore


# ---- bad input: 400 before any work ----

@pytest.mark.parametrize(("messages", "param", "named"), [
    (user("<OD>"), "messages.0.content", "got 0 image_url parts"),
    ([{"role": "user", "content": "<OD>"}], "messages.0.content", "got 0 image_url parts"),
    (user("<OD>", data_url(), data_url()), "messages.0.content", "got 2 image_url parts"),
    (user("<DETECT_CATS>", data_url()), "messages.0.content", "unknown Florence-2 task <DETECT_CATS>"),
    (user("What is this?", data_url()), "messages.0.content", "must start with a Florence-2 task token"),
    (user("<CAPTION> of a cat", data_url()), "messages.0.content", "<CAPTION> takes no text"),
    (user("<OPEN_VOCABULARY_DETECTION>", data_url()), "messages.0.content", "needs text after the task token"),
    (user("<REGION_TO_OCR>the top", data_url()), "messages.0.content", "needs a region"),
    ([{"role": "system", "content": "be brief"}, *user("<OD>", data_url())], "messages", "one user message"),
    ([{"role": "user", "content": [{"type": "text", "text": "<OD>"}, {"type": "image_url", "image_url": {
        "url": data_url()}}, {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}],
     "messages.0.content.2", "not 'input_audio'"),
])
def test_bad_requests_are_400_naming_the_field(address: str, messages: object, param: str, named: str) -> None:
    response = post(address, messages)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and named in error["message"]


def test_bad_request_with_stream_is_a_400_not_a_stream(address: str) -> None:
    response = post(address, user("<NOPE>", data_url()), stream=True)
    assert response.status_code == 400 and "<NOPE>" in response.json()["error"]["message"]


def test_image_limits_are_the_media_layers(address: str) -> None:
    bomb = post(address, user("<OD>", bomb_png()))
    assert bomb.status_code == 400 and bomb.json()["error"]["code"] == "image_too_large", bomb.text
    assert "pixel" in bomb.json()["error"]["message"]
    junk = post(address, user("<OD>", "data:image/png;base64," + base64.b64encode(b"not a png").decode()))
    assert junk.status_code == 400 and junk.json()["error"]["code"] == "invalid_image"
    local = post(address, user("<OD>", "file:///etc/passwd"))  # no --media-path: local files are refused
    assert local.status_code == 400


def test_max_tokens_past_the_decoder_window_is_a_400(address: str) -> None:
    response = post(address, user("<OD>", data_url()), max_tokens=DECODER_WINDOW)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


# ---- the process around the worker ----

def test_models_health_metrics_and_other_routes(address: str, florence2_dir: Path) -> None:
    assert post(address, user("<CAPTION>", data_url()), max_tokens=4).status_code == 200
    models = httpx.get(f"{address}/v1/models").json()["data"]
    assert [(m["id"], m["capabilities"]) for m in models] == [(florence2_dir.name, ["vision"])]
    health = httpx.get(f"{address}/health")
    assert health.status_code == 200 and health.json()["model"] == florence2_dir.name
    [worker] = health.json()["providers"]
    assert worker["worker"] == "florence2" and worker["max_queue_depth"] == 0 and worker["completed"] >= 1
    metrics = httpx.get(f"{address}/metrics").text
    assert 'mlxcel_worker_completed_total{worker="florence2"}' in metrics
    totals = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith(("mlxcel_requests_total", "mlxcel_prompt_tokens_total"))}
    assert totals["mlxcel_requests_total"] >= 1 and totals["mlxcel_prompt_tokens_total"] > 17  # K2 counts them
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/messages", {"model": "m", "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hi"}]}), ("/tokenize", {"content": "hi"})):
        response = httpx.post(address + path, json=body)
        assert response.status_code == 501 and "florence2" in response.text, (path, response.text)


def test_a_second_request_past_max_queue_depth_is_503(address: str) -> None:
    before = _worker(address)["requests"]
    long = threading.Thread(target=post, args=(address, user("<OD>", data_url())), kwargs={
        "max_tokens": DECODER_WINDOW - 1})
    long.start()
    try:
        deadline = time.monotonic() + 30
        while _worker(address)["requests"] == before and time.monotonic() < deadline:
            time.sleep(0.01)
        busy = post(address, user("<OD>", data_url()), max_tokens=4)  # the long one is still decoding
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1", busy.text
        assert "queue is full" in busy.json()["error"]["message"]
    finally:
        long.join(60)
    assert _worker(address)["rejected"] >= 1


def _worker(address: str) -> dict[str, int]:
    return httpx.get(f"{address}/health").json()["providers"][0]


def test_a_request_past_decode_timeout_is_504(florence2_dir: Path) -> None:
    """Issue 47: a generation that cannot finish in time whatever the load (each decoding step made at least
    50 ms, 255 of them against 0.2 s), served by serve's own startup path; the worker checks the deadline
    between steps, so neither a fast machine nor a starved event loop can make this a 200."""
    from mlxcel.server.lifecycle import ServerThread
    from mlxcel.startup import build_process, server_state
    from tests.cli.test_cli import settings

    serve = settings(["-m", str(florence2_dir), "--decode-timeout", "0.2", "--port", "0", "--no-warmup"])
    process = build_process(serve)
    provider = process.side.florence2
    assert provider is not None
    steps: list[int] = []
    provider.model.lm_head.register_forward_pre_hook(lambda module, args: steps.append(1) or time.sleep(0.05))
    state, _ = server_state(process, serve)
    server = ServerThread(state).start()
    try:
        response = post(server.address, user("<OD>", data_url()), max_tokens=DECODER_WINDOW - 1)
        assert response.status_code == 504, response.text
        assert response.json()["error"]["type"] == "timeout_error"
        assert _worker(server.address)["timed_out"] == 1
    finally:
        server.stop()
        assert process.side.stop(60)  # joins once the decoding stopped at its next step
    assert len(steps) < DECODER_WINDOW - 1


def test_side_flags_with_a_florence2_checkpoint_fail_startup(florence2_dir: Path) -> None:
    import subprocess
    import sys

    from tests.server.test_single_purpose import SERVER

    result = subprocess.run([sys.executable, "-c", SERVER, "--port", "0", "-m", str(florence2_dir),
                             "--embedding-model", str(florence2_dir)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "Florence-2 checkpoint" in result.stderr and "--embedding-model" in result.stderr
