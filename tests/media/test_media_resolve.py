"""C2-C5: the routes' entry point, end to end over real files, data: URLs and a loopback server."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from mlxcel.env import media_policy
from mlxcel.media import (
    MediaError,
    MediaKind,
    MediaPolicy,
    MediaRef,
    MediaRoot,
    MediaSource,
    Reason,
    check_image_count,
    resolve_media_parts,
)

from media_net import LoopbackOnlyTransport, LoopbackServer, Reply
from video_files import make_video


def png(width: int = 5, height: int = 4) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (1, 2, 3)).save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    (root / "videos").mkdir(parents=True)
    (root / "cat.png").write_bytes(png(7, 6))
    (root / "link.png").symlink_to("cat.png")
    (root / "notes.txt").write_bytes(b"not an image")
    (root / "clip.mp4").write_bytes(make_video(30, rate=10))  # 3 s
    (root / "videos" / "ok.mp4").write_bytes(make_video(4, rate=2))
    return root


def resolve(parts: list[MediaRef], policy: MediaPolicy, **kwargs: Any) -> Any:
    return asyncio.run(resolve_media_parts(parts, policy, **kwargs))


def refused(parts: list[MediaRef], policy: MediaPolicy, **kwargs: Any) -> MediaError:
    with pytest.raises(MediaError) as caught:
        resolve(parts, policy, **kwargs)
    return caught.value


def image(url: str) -> MediaRef:
    return MediaRef(MediaKind.IMAGE, url)


def test_c4_data_url_image_is_resolved_and_decoded() -> None:
    [result] = resolve([image(data_url(png(5, 4)))], MediaPolicy())
    assert result.source is MediaSource.DATA
    assert result.mime_type == "image/png"
    assert result.image is not None
    assert (result.image.width, result.image.height) == (5, 4)


def test_c2_file_inside_the_root_and_symlink_inside_the_root(media_dir: Path) -> None:
    policy = MediaPolicy(media_root=MediaRoot.open(media_dir))
    parts = [image("cat.png"), image("file://link.png"), image(f"file://{media_dir}/cat.png")]
    results = resolve(parts, policy)
    assert [r.source for r in results] == [MediaSource.FILE] * 3
    assert all(r.image is not None and r.image.width == 7 for r in results)


def test_c2_bare_name_without_media_path_is_refused() -> None:
    error = refused([image("cat.png")], MediaPolicy())
    assert error.reason_code is Reason.LOCAL_MEDIA_DISABLED
    assert error.message.startswith("media part 1 (image): ")


def test_c2_rejections_name_the_part_and_the_reason(media_dir: Path) -> None:
    policy = MediaPolicy(media_root=MediaRoot.open(media_dir))
    error = refused([image("cat.png"), image("../secret.png")], policy)
    assert error.reason_code is Reason.INVALID_PATH
    assert error.message.startswith("media part 2 (image): ")
    assert str(error).endswith("[invalid_media_path]")


def test_c4_a_file_that_is_not_an_image_is_refused(media_dir: Path) -> None:
    error = refused([image("notes.txt")], MediaPolicy(media_root=MediaRoot.open(media_dir)))
    assert error.reason_code is Reason.INVALID_IMAGE


def test_c3_loopback_server_with_the_override() -> None:
    async def scenario() -> None:
        async with LoopbackServer({"/cat.png": Reply(body=png(3, 2))}) as server:
            policy = MediaPolicy(allow_private_urls=True)
            [result] = await resolve_media_parts([image(server.url("/cat.png"))], policy)
            assert result.source is MediaSource.HTTP
            assert result.image is not None and result.image.width == 3

    asyncio.run(scenario())


def test_c3_loopback_server_without_the_override_is_never_fetched() -> None:
    async def scenario() -> None:
        async with LoopbackServer({"/cat.png": Reply(body=png())}) as server:
            with pytest.raises(MediaError) as caught:
                await resolve_media_parts([image(server.url("/cat.png"))], MediaPolicy())
            assert caught.value.reason_code is Reason.BLOCKED_ADDRESS
            assert server.requests == []

    asyncio.run(scenario())


def test_c3_injected_resolver_and_transport_reach_the_fetch() -> None:
    async def scenario() -> None:
        async with LoopbackServer({"/cat.png": Reply(body=png(2, 2))}) as server:

            async def resolver(host: str, port: int) -> list[str]:
                return ["93.184.216.34"]

            def transport() -> LoopbackOnlyTransport:
                return LoopbackOnlyTransport({"93.184.216.34": "127.0.0.1"}, report_alias_as_peer=True)

            url = f"http://media.example:{server.port}/cat.png"
            [result] = await resolve_media_parts(
                [image(url)], MediaPolicy(), resolver=resolver, transport_factory=transport
            )
            assert result.image is not None and result.image.width == 2

    asyncio.run(scenario())


def test_c4_too_many_images_is_refused_before_any_fetch() -> None:
    async def scenario() -> None:
        async with LoopbackServer({"/a.png": Reply(body=png())}) as server:
            parts = [image(server.url("/a.png"))] * 3
            with pytest.raises(MediaError) as caught:
                await resolve_media_parts(parts, MediaPolicy(allow_private_urls=True, max_images=2))
            assert caught.value.reason_code is Reason.TOO_MANY_IMAGES
            assert server.requests == []

    asyncio.run(scenario())


def test_c5_video_frames_count_toward_max_images(media_dir: Path) -> None:
    """The decoded frames of a real video (3 s at --video-fps 2: 6 frames) plus an image count."""
    policy = MediaPolicy(media_root=MediaRoot.open(media_dir), video_fps=2.0, max_images=6)
    parts = [MediaRef(MediaKind.VIDEO, "clip.mp4"), image("cat.png")]
    error = refused(parts, policy)
    assert error.reason_code is Reason.TOO_MANY_IMAGES and "7 images (video frames included)" in error.message
    [video] = resolve(parts[:1], policy)
    assert len(video.frames) == 6
    check_image_count(6, policy)
    with pytest.raises(MediaError):
        check_image_count(7, policy)


def test_c4_image_payload_cap_applies_to_data_urls() -> None:
    data = png()
    error = refused([image(data_url(data))], MediaPolicy(max_image_payload_bytes=len(data) - 1))
    assert error.reason_code is Reason.PAYLOAD_TOO_LARGE
    assert "--max-image-payload-size" in error.message


def test_c4_decoder_caps_apply_to_resolved_images() -> None:
    error = refused([image(data_url(png(50, 50)))], MediaPolicy(max_image_pixels=100))
    assert error.reason_code is Reason.IMAGE_TOO_LARGE


def test_c4_audio_per_clip_and_per_request_caps() -> None:
    clip = data_url(b"a" * 100, "audio/wav")
    audio = MediaRef(MediaKind.AUDIO, clip)
    policy = MediaPolicy(max_audio_clip_bytes=100, max_audio_request_bytes=250)
    results = resolve([audio, audio], policy)
    assert [len(r.data) for r in results] == [100, 100]
    per_clip = refused([MediaRef(MediaKind.AUDIO, data_url(b"a" * 101, "audio/wav"))], policy)
    assert per_clip.reason_code is Reason.PAYLOAD_TOO_LARGE
    assert "per-clip" in per_clip.message
    per_request = refused([audio, audio, audio], policy)
    assert per_request.reason_code is Reason.PAYLOAD_TOO_LARGE
    assert "per-request" in per_request.message
    assert per_request.message.startswith("media part 3 (audio)")


def test_c5_video_sampling_defaults_and_block_fps(media_dir: Path) -> None:
    policy = MediaPolicy(media_root=MediaRoot.open(media_dir), video_max_frames=8, video_fps=1.5)
    parts = [MediaRef(MediaKind.VIDEO, "clip.mp4"), MediaRef(MediaKind.VIDEO, "clip.mp4", fps=4)]
    default, own = resolve(parts, policy)
    assert default.data == (media_dir / "clip.mp4").read_bytes()
    assert default.video is not None and (default.video.fps, default.video.max_frames) == (1.5, 8)
    assert own.video is not None and own.video.fps == 4.0
    assert len(default.frames) == 5 and len(own.frames) == 8  # ceil(3 s x 1.5); 12 at 4 fps, capped


@pytest.mark.parametrize("fps", [0, -1.0, float("nan"), float("inf")])
def test_c5_invalid_block_fps_is_refused(media_dir: Path, fps: float) -> None:
    policy = MediaPolicy(media_root=MediaRoot.open(media_dir))
    error = refused([MediaRef(MediaKind.VIDEO, "clip.mp4", fps=fps)], policy)
    assert error.reason_code is Reason.INVALID_MEDIA_PART


def test_c5_video_dir_allowlist_limits_local_videos(media_dir: Path) -> None:
    policy = media_policy(
        {"MLXCEL_VIDEO_DIR_ALLOWLIST": str(media_dir / "videos")}, media_root=str(media_dir)
    )
    [result] = resolve([MediaRef(MediaKind.VIDEO, "videos/ok.mp4")], policy)
    assert result.data == (media_dir / "videos" / "ok.mp4").read_bytes() and len(result.frames) == 4
    error = refused([MediaRef(MediaKind.VIDEO, "clip.mp4")], policy)
    assert error.reason_code is Reason.VIDEO_DIR_NOT_ALLOWED
    # images are not affected by the video allowlist
    assert resolve([image("cat.png")], policy)[0].image is not None


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("ftp://media.example/cat.png", Reason.UNSUPPORTED_SCHEME),
        ("javascript:alert(1)", Reason.UNSUPPORTED_SCHEME),
        ("C:\\images\\cat.png", Reason.UNSUPPORTED_SCHEME),
        ("", Reason.INVALID_MEDIA_PART),
        ("data:image/png;base64,@@@@", Reason.INVALID_DATA_URL),
    ],
)
def test_c2_c3_unsupported_references(url: str, reason: Reason) -> None:
    assert refused([image(url)], MediaPolicy()).reason_code is reason
