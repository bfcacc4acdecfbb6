"""Image generation (spec J) end to end: a real mlxcel-server on port 0 serving a tiny random-weight Stable
Diffusion pipeline written to disk (tests/workers/tiny_image_pipeline.py) through `--image-model DIR`, called
with the real openai SDK (`images.generate`, `images.edit`, streaming) and httpx.

Covers the image-only process (no -m: /v1/models lists the id with the image capability only, text
routes answer the structured 501 naming --image-model), chat beside images, the 503 (queue full) and
504 (past --image-request-timeout-secs) answers, the startup conflicts and a fatal load failure.
"""

from __future__ import annotations

import base64
import io
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from mlxcel.loading.resolve import default_model_path
from tests.server.test_single_purpose import SERVER, assert_chat_routes_501, server_process
from tests.workers.tiny_image_pipeline import write_tiny_pipeline

pytestmark = pytest.mark.slow
pytest.importorskip("diffusers")

TIMEOUT_S = 5  # --image-request-timeout-secs of the server that checks 503 and 504


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_pipeline(tmp_path_factory.mktemp("image") / "tiny-sd")


@pytest.fixture(scope="module")
def image_server(pipeline_dir: Path) -> Iterator[tuple[str, list[str]]]:
    """Image-only: --image-model and no -m; named by --alias."""
    with server_process("--image-model", str(pipeline_dir), "--alias", "painter", "--metrics") as server:
        yield server


def _client(address: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=address + "/v1", api_key="unused", max_retries=0, timeout=60)


def _png(b64: str) -> Image.Image:
    data = base64.b64decode(b64)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def test_j_openai_sdk_generates_pngs_of_the_asked_size_and_a_seed_repeats(image_server: tuple[str, list[str]]) -> None:
    address, log = image_server
    client = _client(address)
    first = client.images.generate(prompt="a red cat", n=2, size="64x32", response_format="b64_json",
                                   extra_body={"seed": 7, "steps": 2})
    assert first.data is not None and len(first.data) == 2 and first.size == "64x32"
    images = [_png(item.b64_json or "") for item in first.data]
    assert [image.size for image in images] == [(64, 32), (64, 32)]
    again = client.images.generate(prompt="a red cat", n=2, size="64x32", extra_body={"seed": 7, "steps": 2})
    other = client.images.generate(prompt="a red cat", n=2, size="64x32", extra_body={"seed": 8, "steps": 2})
    assert again.data is not None and other.data is not None
    assert [item.b64_json for item in again.data] == [item.b64_json for item in first.data]  # same seed, same bytes
    assert other.data[0].b64_json != first.data[0].b64_json
    default = client.images.generate(prompt="x", extra_body={"steps": 1})  # no size: the pipeline's own (16x16)
    assert default.data is not None and _png(default.data[0].b64_json or "").size == (16, 16)
    assert any("image: step 2 of 2" in line for line in log)  # progress in the log


def test_j_streaming_sends_step_progress_a_partial_image_and_the_completed_png(
        image_server: tuple[str, list[str]]) -> None:
    address, _ = image_server
    events = list(_client(address).images.generate(prompt="a boat", size="32x32", stream=True, partial_images=1,
                                                    extra_body={"seed": 3, "steps": 4}))
    kinds = [event.type for event in events]
    progress = [(event.step, event.num_steps) for event in events  # type: ignore[union-attr]
                if event.type == "image_generation.progress"]
    assert progress == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert kinds.count("image_generation.partial_image") == 1 and kinds[-1] == "image_generation.completed"
    partial = next(event for event in events if event.type == "image_generation.partial_image")
    assert _png(partial.b64_json).size == (32, 32) and partial.partial_image_index == 0
    completed = events[-1]
    assert _png(completed.b64_json).size == (32, 32) and completed.size == "32x32"
    whole = _client(address).images.generate(prompt="a boat", size="32x32", extra_body={"seed": 3, "steps": 4})
    assert whole.data is not None and whole.data[0].b64_json == completed.b64_json  # streaming changes nothing


def test_j_edit_is_image_to_image_on_the_same_pipeline(image_server: tuple[str, list[str]]) -> None:
    address, _ = image_server
    source = io.BytesIO()
    Image.new("RGB", (40, 24), (200, 30, 30)).save(source, "PNG")
    client = _client(address)
    edited = client.images.edit(image=("source.png", source.getvalue(), "image/png"), prompt="make it blue",
                                size="32x16", extra_body={"seed": 1, "steps": 2})
    assert edited.data is not None and _png(edited.data[0].b64_json or "").size == (32, 16)
    same_size = client.images.edit(image=("source.png", source.getvalue(), "image/png"), prompt="blue",
                                   extra_body={"steps": 2})
    assert same_size.data is not None and _png(same_size.data[0].b64_json or "").size == (40, 24)
    bomb = httpx.post(address + "/v1/images/edits", data={"prompt": "x"},
                      files={"image": ("a.png", b"not an image", "image/png")})
    assert bomb.status_code == 400 and bomb.json()["error"]["code"] == "invalid_image"
    masked = httpx.post(address + "/v1/images/edits", data={"prompt": "x"},
                        files={"image": ("a.png", source.getvalue(), "image/png"),
                               "mask": ("m.png", source.getvalue(), "image/png")})
    assert masked.status_code == 400 and "mask" in masked.json()["error"]["message"]


def test_j_bad_fields_are_400s_naming_them(image_server: tuple[str, list[str]]) -> None:
    address, _ = image_server
    cases = {"response_format": {"prompt": "x", "response_format": "url"}, "size": {"prompt": "x", "size": "33x32"},
             "prompt": {"n": 1}, "n": {"prompt": "x", "n": 11}, "steps": {"prompt": "x", "steps": 0},
             "partial_images": {"prompt": "x", "partial_images": 4}, "seed": {"prompt": "x", "seed": "7"}}
    for field, body in cases.items():
        response = httpx.post(address + "/v1/images/generations", json=body, timeout=60)
        assert response.status_code == 400, (field, response.text)
        assert response.json()["error"]["message"].startswith(field), (field, response.text)


def test_j_openapi_describes_the_image_routes_this_process_serves(image_server: tuple[str, list[str]]) -> None:
    schema = httpx.get(image_server[0] + "/openapi.json").json()
    generations = schema["paths"]["/v1/images/generations"]["post"]["requestBody"]["content"]["application/json"]
    edits = schema["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"]["multipart/form-data"]
    components = schema["components"]["schemas"]
    assert generations["schema"]["$ref"].endswith("/ImageGenerationRequest")
    assert edits["schema"]["$ref"].endswith("/ImageEditRequest")
    assert components["ImageEditRequest"]["required"] == ["prompt", "image"]
    assert {"prompt", "size", "seed", "stream"} <= set(components["ImageGenerationRequest"]["properties"])


def test_j_image_only_process_lists_the_image_model_and_answers_text_routes_501(
        image_server: tuple[str, list[str]]) -> None:
    address, _ = image_server
    models = httpx.get(address + "/v1/models").json()["data"]
    assert [(model["id"], model["capabilities"]) for model in models] == [("painter", ["image"])]
    health = httpx.get(address + "/health")
    assert health.status_code == 200 and health.json()["model"] == "painter"
    assert [(p["model"], p["capability"]) for p in health.json()["providers"]] == [("painter", "image")]
    assert_chat_routes_501(address, "image-only", "--image-model")
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    message = httpx.post(address + "/v1/chat/completions", json=chat).json()["error"]["message"]
    assert "--image-model and no -m" in message
    metrics = httpx.get(address + "/metrics").text
    assert 'mlxcel_worker_requests_total{worker="image"}' in metrics


def test_j_full_queue_is_503_and_a_late_request_504(pipeline_dir: Path) -> None:
    with server_process("--image-model", str(pipeline_dir), "--image-queue-depth", "1",
                        "--image-request-timeout-secs", str(TIMEOUT_S)) as (address, _):
        _check_503_and_504(address)


def _check_503_and_504(address: str) -> None:
    slow = {"prompt": "slow", "size": "256x256", "steps": 500}  # far past the 5 s deadline on a CPU
    answers: dict[str, httpx.Response] = {}

    def post(name: str, body: dict[str, object]) -> None:
        answers[name] = httpx.post(address + "/v1/images/generations", json=body, timeout=60)

    running = threading.Thread(target=post, args=("running", slow))
    running.start()
    time.sleep(1.5)  # taken by the worker: the one job at a time
    waiting = threading.Thread(target=post, args=("waiting", {"prompt": "next", "size": "16x16", "steps": 1}))
    waiting.start()
    time.sleep(0.5)
    refused = httpx.post(address + "/v1/images/generations", json={"prompt": "x", "steps": 1})
    assert refused.status_code == 503 and "queue is full" in refused.json()["error"]["message"]
    assert "Retry-After" in refused.headers
    running.join(60)
    waiting.join(60)
    late = answers["running"]
    assert late.status_code == 504 and "--image-request-timeout-secs" in late.json()["error"]["message"]
    assert answers["waiting"].status_code in (200, 504)
    for _ in range(60):  # the aborted run stops at its next step: the worker serves again
        after = httpx.post(address + "/v1/images/generations", json={"prompt": "x", "steps": 1, "size": "16x16"},
                           timeout=60)
        if after.status_code == 200:
            break
        time.sleep(0.5)
    assert after.status_code == 200, after.text


def test_j_chat_model_and_image_model_in_one_process(pipeline_dir: Path) -> None:
    chat_model = str(default_model_path())  # -m given: chat beside the images, not an image-only process
    with server_process("-m", chat_model, "-c", "512", "--image-model", str(pipeline_dir)) as (address, _):
        models = {model["id"]: model["capabilities"] for model in httpx.get(address + "/v1/models").json()["data"]}
        assert models.get("tiny-sd") == ["image"] and len(models) == 2
        chat = httpx.post(address + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, timeout=120)
        assert chat.status_code == 200, chat.text
        image = _client(address).images.generate(prompt="a cat", size="16x16", extra_body={"steps": 1})
        assert image.data is not None and _png(image.data[0].b64_json or "").size == (16, 16)


def _start_fails(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SERVER, "--port", "0", "--no-warmup", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("flags", [("--webui",), ("--embedding-model", "all-minilm-l6-v2"), ("--reranking",),
                                   ("--models-dir", "/tmp")])
def test_j_image_only_conflicts_fail_startup_naming_both_flags(pipeline_dir: Path, flags: tuple[str, ...]) -> None:
    result = _start_fails("--image-model", str(pipeline_dir), *flags)
    assert result.returncode == 1, result.stderr
    assert "--image-model" in result.stderr and flags[0] in result.stderr and "listening" not in result.stderr


def test_j_image_model_load_failure_is_fatal_at_startup(tmp_path: Path) -> None:
    (tmp_path / "not-a-pipeline").mkdir()
    result = _start_fails("--image-model", str(tmp_path / "not-a-pipeline"))
    assert result.returncode == 1 and "model_index.json" in result.stderr, result.stderr
    broken = write_tiny_pipeline(tmp_path / "broken")
    next((broken / "unet").glob("*.safetensors")).write_bytes(b"garbage")
    result = _start_fails("--image-model", str(broken))
    assert result.returncode == 1 and "did not load" in result.stderr, result.stderr
