"""C5: video_url parts decoded into ordered still frames with PyAV, --video-fps / --video-max-frames
applied, frames counted toward --max-images. The videos are made with PyAV here (video_files.py)."""

from __future__ import annotations

import asyncio
import base64
import io

import av
import pytest
from PIL import Image

from mlxcel.media import MediaError, MediaKind, MediaPolicy, MediaRef, Reason, resolve_media_parts
from mlxcel.media.video import _sample, decode_video_frames, spread_indices

from video_files import frame_index, make_video


def video_ref(data: bytes, fps: float | None = None) -> MediaRef:
    return MediaRef(MediaKind.VIDEO, "data:video/mp4;base64," + base64.b64encode(data).decode(), fps=fps)


def png_ref() -> MediaRef:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, "PNG")
    return MediaRef(MediaKind.IMAGE, "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode())


def resolve(parts: list[MediaRef], policy: MediaPolicy) -> list:  # type: ignore[type-arg]
    return asyncio.run(resolve_media_parts(parts, policy))


def test_c5_frames_are_sampled_at_the_policy_fps_in_order() -> None:
    [video] = resolve([video_ref(make_video(30, rate=10))], MediaPolicy(video_fps=2.0, video_max_frames=16))
    assert [frame_index(f) for f in video.frames] == [0, 5, 10, 15, 20, 25]  # one every 0.5 s of 3 s
    assert all(f.mode == "RGB" and f.size == (64, 48) for f in video.frames)


def test_c5_the_block_fps_wins_over_the_policy() -> None:
    [video] = resolve([video_ref(make_video(30, rate=10), fps=1.0)], MediaPolicy(video_fps=2.0))
    assert [frame_index(f) for f in video.frames] == [0, 10, 20]


def test_c5_max_frames_keeps_frames_spread_over_the_whole_video() -> None:
    [video] = resolve([video_ref(make_video(30, rate=10))], MediaPolicy(video_fps=10.0, video_max_frames=4))
    assert [frame_index(f) for f in video.frames] == [0, 10, 19, 29]


def test_c5_a_long_video_keeps_max_frames_spread_over_it() -> None:
    frames = decode_video_frames(make_video(100, rate=10, step=2), fps=10.0, max_frames=3, policy=MediaPolicy())
    indices = [frame_index(f, step=2) for f in frames]  # a step of 2 levels: lossy coding blurs it by 1
    assert len(indices) == 3 and all(abs(got - want) <= 1 for got, want in zip(indices, [0, 50, 99]))


def test_c5_without_a_duration_candidates_are_thinned_while_decoding() -> None:
    with av.open(io.BytesIO(make_video(100, rate=10, step=2))) as container:
        kept = _sample(container.decode(container.streams.video[0]), 0.1, 3, MediaPolicy())
    indices = [frame_index(image, step=2) for _, image in kept]
    assert 3 <= len(indices) <= 6 and indices[0] == 0 and indices == sorted(indices) and indices[-1] >= 60


def test_c5_video_frames_count_toward_max_images() -> None:
    """6 frames + 1 image against --max-images 6 is refused; 7 is enough."""
    parts = [video_ref(make_video(30, rate=10)), png_ref()]
    with pytest.raises(MediaError) as caught:
        resolve(parts, MediaPolicy(video_fps=2.0, max_images=6))
    assert caught.value.reason_code is Reason.TOO_MANY_IMAGES and "video frames included" in caught.value.message
    assert "7 images" in caught.value.message
    assert len(resolve(parts, MediaPolicy(video_fps=2.0, max_images=7))) == 2
    capped = resolve(parts, MediaPolicy(video_fps=2.0, video_max_frames=2, max_images=3))
    assert len(capped[0].frames) == 2


@pytest.mark.parametrize("data", [b"video-bytes", b"\x00\x00\x00\x18ftypmp42", b""])
def test_c5_undecodable_video_is_refused(data: bytes) -> None:
    with pytest.raises(MediaError) as caught:
        resolve([video_ref(data)], MediaPolicy())
    assert caught.value.reason_code in (Reason.INVALID_VIDEO, Reason.INVALID_DATA_URL)
    assert caught.value.message.startswith("media part 1 (video)")


def test_c5_frames_over_the_decoder_caps_are_refused() -> None:
    with pytest.raises(MediaError) as caught:
        resolve([video_ref(make_video(5, width=64, height=48))], MediaPolicy(max_image_pixels=1000))
    assert caught.value.reason_code is Reason.IMAGE_TOO_LARGE


def test_c5_spread_indices() -> None:
    assert spread_indices(3, 5) == [0, 1, 2]
    assert spread_indices(10, 1) == [0]
    assert spread_indices(11, 3) == [0, 5, 10]


# ---- issue 26 point 8: PyAV only where a video is decoded ----

BLOCK_AV = "import sys; sys.modules['av'] = None; from mlxcel.cli import main; sys.exit(main())"  # import av fails


@pytest.mark.slow
def test_c5_a_text_chat_server_never_imports_pyav() -> None:
    """`mlxcel serve` where `import av` raises (a slim container without PyAV): startup and a text chat
    request work; a video part is the one thing that needs it."""
    import subprocess
    import sys

    import httpx

    from tests.server.test_process import read_address

    command = [sys.executable, "-c", BLOCK_AV, "serve", "--port", "0", "-c", "512", "-np", "1", "--no-warmup"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    try:
        address = read_address(process, lines, timeout=240)
        body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
        reply = httpx.post(address + "/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        process.terminate()
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert "Traceback" not in "".join(lines)
