"""C2-C5: MediaPolicy construction, MLXCEL_* parsing and validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxcel.env import media_policy
from mlxcel.media.errors import MediaConfigError
from mlxcel.media.limits import MediaPolicy
from mlxcel.media.paths import MediaRoot


def test_c5_defaults_match_the_spec() -> None:
    policy = media_policy({})
    assert policy.video_max_frames == 16
    assert policy.video_fps == 2.0
    assert policy.fetch_timeout_s == 10.0
    assert policy.max_redirects == 5
    assert policy.allow_private_urls is False
    assert policy.media_root is None
    assert policy.video_dir_allowlist == ()


def test_c5_env_values_are_read(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    env = {
        "MLXCEL_VIDEO_MAX_FRAMES": "8",
        "MLXCEL_VIDEO_FPS": "0.5",
        "MLXCEL_VIDEO_DIR_ALLOWLIST": f"{tmp_path / 'a'}:{tmp_path / 'b'}",
        "MLXCEL_ALLOW_PRIVATE_MEDIA_URLS": "1",
    }
    policy = media_policy(env)
    assert policy.video_max_frames == 8
    assert policy.video_fps == 0.5
    assert policy.video_dir_allowlist == ((tmp_path / "a").resolve(), (tmp_path / "b").resolve())
    assert policy.allow_private_urls is True


def test_c5_cli_values_win_over_env_and_none_means_not_given(tmp_path: Path) -> None:
    env = {"MLXCEL_VIDEO_MAX_FRAMES": "8", "MLXCEL_VIDEO_FPS": "3"}
    policy = media_policy(
        env, video_max_frames=4, video_fps=None, media_root=str(tmp_path), max_images=3
    )
    assert policy.video_max_frames == 4
    assert policy.video_fps == 3.0
    assert policy.max_images == 3
    assert isinstance(policy.media_root, MediaRoot)
    assert policy.media_root.canonical == tmp_path.resolve()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MLXCEL_VIDEO_MAX_FRAMES", "0"),
        ("MLXCEL_VIDEO_MAX_FRAMES", "-3"),
        ("MLXCEL_VIDEO_MAX_FRAMES", "2.5"),
        ("MLXCEL_VIDEO_MAX_FRAMES", "many"),
        ("MLXCEL_VIDEO_FPS", "0"),
        ("MLXCEL_VIDEO_FPS", "-1"),
        ("MLXCEL_VIDEO_FPS", "nan"),
        ("MLXCEL_VIDEO_FPS", "inf"),
        ("MLXCEL_VIDEO_FPS", "fast"),
        ("MLXCEL_VIDEO_DIR_ALLOWLIST", "relative/dir"),
        ("MLXCEL_VIDEO_DIR_ALLOWLIST", "/definitely/not/here"),
        ("MLXCEL_ALLOW_PRIVATE_MEDIA_URLS", "maybe"),
    ],
)
def test_c5_invalid_env_values_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(MediaConfigError, match=name):
        media_policy({name: value})


@pytest.mark.parametrize(
    ("text", "expected"), [("1", True), ("true", True), ("ON", True), ("0", False), ("", False)]
)
def test_c3_private_override_parsing(text: str, expected: bool) -> None:
    assert media_policy({"MLXCEL_ALLOW_PRIVATE_MEDIA_URLS": text}).allow_private_urls is expected


@pytest.mark.parametrize(
    "overrides",
    [
        {"max_images": 0},
        {"max_image_pixels": -1},
        {"fetch_timeout_s": 0},
        {"max_redirects": -1},
        {"max_images": True},
    ],
)
def test_c4_policy_rejects_nonsense_limits(overrides: dict[str, object]) -> None:
    with pytest.raises(MediaConfigError):
        MediaPolicy(**overrides)  # type: ignore[arg-type]


def test_c2_media_root_flag_must_exist(tmp_path: Path) -> None:
    with pytest.raises(MediaConfigError, match="--media-path"):
        media_policy({}, media_root=str(tmp_path / "missing"))


def test_unknown_option_is_a_config_error() -> None:
    with pytest.raises(MediaConfigError, match="unknown media option"):
        media_policy({}, max_widgets=3)
