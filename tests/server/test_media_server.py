"""Media parts of OpenAI chat through the real server (C2-C5): every reference is resolved and
checked by the media layer first, then refused because the served model reads text only.

tests/media's guard is autouse here too: a connect or name lookup to any non-loopback host,
by the test or by the server thread fetching media, fails the test.
"""

from __future__ import annotations

import base64
import io
import random
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from mlxcel.env import media_policy
from mlxcel.media import MediaPolicy, MediaRoot
from mlxcel.serving.served_model import ServedModel
from mlxcel.server.lifecycle import ServerThread
from mlxcel.server.state import ServerState
from tests.media import media_net
from tests.media.video_files import make_video
from tests.server.conftest import SERVER

sys.modules.setdefault("media_net", media_net)  # tests/media/conftest.py imports it by its bare name
from tests.media.conftest import loopback_only  # noqa: E402,F401 - autouse: no connection leaves loopback

pytestmark = pytest.mark.slow

NOT_IMAGE = "the served model does not accept image input"


def png_bytes(size: int = 4) -> bytes:
    """A real PNG of random pixels (noise does not compress, so the size tracks `size`)."""
    buffer = io.BytesIO()
    Image.frombytes("RGB", (size, size), random.Random(size).randbytes(size * size * 3)).save(buffer, "PNG")
    return buffer.getvalue()


class ImageServer:
    """A real HTTP server on 127.0.0.1 port 0 serving one PNG at /cat.png; counts requests."""

    def __init__(self, body: bytes) -> None:
        self.paths: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                owner.paths.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                return None

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/cat.png"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def media_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "cat.png").write_bytes(png_bytes())
    (root / "big.png").write_bytes(png_bytes(64))
    return root


@pytest.fixture(scope="module")
def media_server(served: ServedModel) -> Iterator[Callable[[MediaPolicy], str]]:
    """Start a server over the session model with a given media policy; returns its address."""
    threads: list[ServerThread] = []

    def start(policy: MediaPolicy) -> str:
        threads.append(ServerThread(ServerState(SERVER, served, media=policy)).start())
        return threads[-1].address

    yield start
    for thread in threads:
        thread.stop()


@pytest.fixture(scope="module")
def sandboxed(media_server: Callable[[MediaPolicy], str], media_root: Path) -> str:
    """--media-path ROOT --max-image-payload-size 2000; private addresses blocked (the default)."""
    return media_server(MediaPolicy(media_root=MediaRoot.open(media_root), max_image_payload_bytes=2000))


@pytest.fixture(scope="module")
def private_ok(media_server: Callable[[MediaPolicy], str]) -> str:
    """MLXCEL_ALLOW_PRIVATE_MEDIA_URLS=1, read from an environment snapshot as the CLI does."""
    policy = media_policy({"MLXCEL_ALLOW_PRIVATE_MEDIA_URLS": "1"}, max_image_payload_bytes=2000)
    assert policy.allow_private_urls
    return media_server(policy)


def image_chat(url: object, part: str = "image_url", **fields: object) -> dict[str, object]:
    content = [{"type": "text", "text": "What is this?"}, {"type": part, part: url}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


def post_chat(address: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(address + "/v1/chat/completions", json=body, timeout=60)


def assert_refused(response: httpx.Response, code: str, words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code, error
    assert words in error["message"], error["message"]


@pytest.mark.parametrize("url", ["file://cat.png", "cat.png", {"url": "file://cat.png", "detail": "low"}])
def test_c2_file_under_media_path_is_read_then_refused_as_text_only(sandboxed: str, url: object) -> None:
    assert_refused(post_chat(sandboxed, image_chat(url)), "media_not_accepted", NOT_IMAGE)


def test_c2_openai_sdk_sees_the_400(sandboxed: str) -> None:
    client = openai.OpenAI(base_url=sandboxed + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "file://cat.png"}}]}], max_tokens=4)
    assert caught.value.status_code == 400 and NOT_IMAGE in str(caught.value)


def test_c2_streaming_request_gets_the_400_before_any_stream(sandboxed: str) -> None:
    response = post_chat(sandboxed, image_chat("file://cat.png", stream=True))
    assert response.headers["content-type"].startswith("application/json")
    assert_refused(response, "media_not_accepted", NOT_IMAGE)


@pytest.mark.parametrize(("url", "code", "words"), [
    ("file://../etc/passwd", "invalid_media_path", ".."),
    ("file:///etc/passwd", "media_path_escape", "outside"),
    ("%2e%2e/secret.png", "invalid_media_path", "percent"),
    ("file://missing.png", "media_not_found", "missing.png"),
    ("ftp://127.0.0.1/cat.png", "unsupported_url_scheme", "ftp"),
])
def test_c2_rejected_paths_name_the_reason(sandboxed: str, url: str, code: str, words: str) -> None:
    assert_refused(post_chat(sandboxed, image_chat(url)), code, words)


def test_c2_without_media_path_local_files_are_refused(media_server: Callable[[MediaPolicy], str]) -> None:
    address = media_server(MediaPolicy())
    assert_refused(post_chat(address, image_chat("file://cat.png")), "local_media_disabled", "--media-path")


@pytest.mark.parametrize("url", [
    "http://169.254.169.254/latest/meta-data/",  # cloud metadata (link-local)
    "http://10.0.0.1/cat.png",
    "http://[::ffff:192.168.0.1]/cat.png",  # IPv4-mapped IPv6
    "http://0x7f.1/cat.png",  # loopback in hex/short form
])
def test_c3_blocked_addresses_are_refused_without_a_connection(sandboxed: str, url: str) -> None:
    assert_refused(post_chat(sandboxed, image_chat(url)), "blocked_address", "")


def test_c3_loopback_server_refused_without_the_override_and_never_fetched(sandboxed: str) -> None:
    image = ImageServer(png_bytes())
    try:
        assert_refused(post_chat(sandboxed, image_chat(image.url)), "blocked_address", "")
        assert image.paths == []
    finally:
        image.close()


def test_c3_loopback_server_fetched_with_the_override(private_ok: str) -> None:
    image = ImageServer(png_bytes())
    try:
        assert_refused(post_chat(private_ok, image_chat({"url": image.url})), "media_not_accepted", NOT_IMAGE)
        assert image.paths == ["/cat.png"]
    finally:
        image.close()


def test_c4_oversized_payloads_are_refused(sandboxed: str, private_ok: str) -> None:
    big = png_bytes(64)
    assert len(big) > 2000
    data_url = "data:image/png;base64," + base64.b64encode(big).decode()
    assert_refused(post_chat(sandboxed, image_chat(data_url)), "payload_too_large", "--max-image-payload-size")
    assert_refused(post_chat(sandboxed, image_chat("big.png")), "payload_too_large", "--max-image-payload-size")
    image = ImageServer(big)
    try:
        assert_refused(post_chat(private_ok, image_chat(image.url)), "payload_too_large", "")
    finally:
        image.close()


def test_c4_a_valid_data_url_image_is_decoded_then_refused(sandboxed: str) -> None:
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    assert_refused(post_chat(sandboxed, image_chat(data_url)), "media_not_accepted", NOT_IMAGE)
    broken = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()
    assert_refused(post_chat(sandboxed, image_chat(broken)), "invalid_image", "")


def test_c4_audio_and_video_parts_are_resolved_and_named(sandboxed: str, media_root: Path) -> None:
    audio = {"data": base64.b64encode(b"RIFF....WAVEfmt ").decode(), "format": "wav"}
    assert_refused(post_chat(sandboxed, image_chat(audio, "input_audio")), "media_not_accepted",
                   "does not accept audio input")
    (media_root / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    assert_refused(post_chat(sandboxed, image_chat({"url": "broken.mp4", "fps": 1}, "video_url")),
                   "invalid_video", "video")  # C5: decoded into frames before the model's refusal
    (media_root / "clip.mp4").write_bytes(make_video(10, rate=10))
    assert_refused(post_chat(sandboxed, image_chat({"url": "clip.mp4", "fps": 1}, "video_url")),
                   "media_not_accepted", "does not accept video input")
    assert_refused(post_chat(sandboxed, image_chat({"url": "clip.mp4", "fps": 0}, "video_url")),
                   "invalid_media_part", "fps")


def test_c4_malformed_media_parts_are_400(sandboxed: str) -> None:
    response = post_chat(sandboxed, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert response.status_code == 400 and "image_url" in response.json()["error"]["message"]
    audio = {"data": "AAAA", "format": "wav; rm -rf"}
    assert_refused(post_chat(sandboxed, image_chat(audio, "input_audio")), "invalid_media_part", "format")


def test_c4_text_only_requests_are_untouched(sandboxed: str) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 2,
            "temperature": 0}
    assert post_chat(sandboxed, body).status_code == 200
