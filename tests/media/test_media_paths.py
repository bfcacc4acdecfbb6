"""C2: local media under --media-path, with real files, symlinks and a FIFO in a temporary root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mlxcel.media.errors import MediaConfigError, MediaError, Reason
from mlxcel.media.paths import MediaRoot, read_local_media, read_under_root, resolve_local_path

CAT = b"cat-bytes"


@pytest.fixture
def root(tmp_path: Path) -> MediaRoot:
    media = tmp_path / "media"
    (media / "sub").mkdir(parents=True)
    (media / "cat.png").write_bytes(CAT)
    (media / "sub" / "dog.png").write_bytes(b"dog")
    (media / "my cat.png").write_bytes(b"spaced")
    (tmp_path / "secret.txt").write_bytes(b"outside")
    return MediaRoot.open(media)


# Every form the spec says is refused on its text, before the filesystem is touched.
REJECTED_FORMS = [
    ("../secret.txt", "'..'"),
    ("sub/../cat.png", "'..'"),
    ("..", "'..'"),
    ("file://../secret.txt", "'..'"),
    ("cat..png", "'..'"),
    ("cat\x00.png", "control character"),
    ("cat\n.png", "control character"),
    ("cat\r.png", "control character"),
    ("cat\x1b.png", "control character"),
    ("cat\x7f.png", "control character"),
    ("cat\x85.png", "control character"),
    ("cat\u202e.png", "format character"),
    ("cat:1.png", "':'"),
    ("cat*.png", "'*'"),
    ("cat?.png", "'?'"),
    ('cat".png', "'\"'"),
    ("cat<.png", "'<'"),
    ("cat>.png", "'>'"),
    ("cat|.png", "'|'"),
    (" cat.png", "whitespace"),
    ("cat.png ", "whitespace"),
    ("sub /dog.png", "whitespace"),
    ("sub/ dog.png", "whitespace"),
    ("cat.png\u00a0", "whitespace"),
    ("\u3000cat.png", "whitespace"),
    ("cat.", "ending in '.'"),
    ("sub./dog.png", "ending in '.'"),
    ("./cat.png", "ending in '.'"),
    ("a" * 256, "255 bytes"),
    ("\u00e9" * 128, "255 bytes"),
    ("sub\u2215dog.png", "U+2215"),
    ("sub\u2044dog.png", "U+2044"),
    ("sub\uff0fdog.png", "U+FF0F"),
    ("sub\u29f8dog.png", "U+29F8"),
    ("sub\uff3cdog.png", "U+FF3C"),
    ("sub\u29f5dog.png", "U+29F5"),
    ("sub\u2216dog.png", "U+2216"),
    ("sub\ufe68dog.png", "U+FE68"),
    ("\uff0e\uff0e/secret.txt", "U+FF0E"),
    ("\u2025/secret.txt", "U+2025"),
    ("sub\\dog.png", "backslash"),
    ("%2e%2e/secret.txt", "percent-escapes"),
    ("file://%2e%2e/secret.txt", "percent-escapes"),
    ("file://%2E%2E/secret.txt", "percent-escapes"),
    ("file://sub%2fdog.png", "percent-escapes"),
    ("file://sub%5cdog.png", "percent-escapes"),
    ("file://cat%00.png", "percent-escapes"),
    ("file://%252e%252e/secret.txt", "percent-escapes"),
    ("file://%c0%ae%c0%ae/secret.txt", "UTF-8"),
    ("file://cat%0a.png", "control character"),
    ("", "empty"),
    ("file://", "empty"),
]


@pytest.mark.parametrize(("reference", "why"), REJECTED_FORMS)
def test_c2_rejected_path_forms(root: MediaRoot, reference: str, why: str) -> None:
    with pytest.raises(MediaError) as caught:
        read_local_media(reference, root, max_bytes=1024)
    assert caught.value.reason_code is Reason.INVALID_PATH
    assert why in caught.value.message


@pytest.mark.parametrize("reference", ["cat.png", "file://cat.png", "file:///etc/passwd", "sub/dog.png"])
def test_c2_without_media_path_every_local_reference_is_refused(reference: str) -> None:
    with pytest.raises(MediaError) as caught:
        read_local_media(reference, None, max_bytes=1024)
    assert caught.value.reason_code is Reason.LOCAL_MEDIA_DISABLED
    assert "--media-path" in caught.value.message


def test_c2_bare_name_file_url_and_absolute_url_read_the_same_file(root: MediaRoot) -> None:
    absolute = f"file://{root.canonical}/cat.png"
    for reference in ("cat.png", "file://cat.png", absolute, f"{root.canonical}/cat.png", "file:cat.png"):
        assert read_local_media(reference, root, max_bytes=1024) == CAT, reference


def test_c2_subdirectories_and_percent_decoded_names(root: MediaRoot) -> None:
    assert read_local_media("file://sub/dog.png", root, max_bytes=1024) == b"dog"
    assert read_local_media("file://my%20cat.png", root, max_bytes=1024) == b"spaced"


def test_c2_absolute_path_through_a_symlinked_root_is_inside(tmp_path: Path, root: MediaRoot) -> None:
    link = tmp_path / "media-link"
    link.symlink_to(root.canonical, target_is_directory=True)
    linked_root = MediaRoot.open(link)
    assert linked_root.canonical == root.canonical
    assert read_local_media(f"file://{link}/cat.png", linked_root, max_bytes=1024) == CAT


@pytest.mark.parametrize("reference", ["file:///etc/passwd", "/etc/passwd", "file:///tmp"])
def test_c2_absolute_paths_outside_the_root_escape(root: MediaRoot, reference: str) -> None:
    with pytest.raises(MediaError) as caught:
        read_local_media(reference, root, max_bytes=1024)
    assert caught.value.reason_code is Reason.PATH_ESCAPE


def test_c2_symlink_inside_the_root_works(root: MediaRoot) -> None:
    (root.canonical / "alias.png").symlink_to("cat.png")
    (root.canonical / "subalias").symlink_to("sub", target_is_directory=True)
    assert read_local_media("alias.png", root, max_bytes=1024) == CAT
    assert read_local_media("subalias/dog.png", root, max_bytes=1024) == b"dog"


def test_c2_symlinks_escaping_the_root_are_refused(root: MediaRoot) -> None:
    outside = root.canonical.parent
    (root.canonical / "leak.txt").symlink_to(outside / "secret.txt")
    (root.canonical / "up").symlink_to(outside, target_is_directory=True)
    for reference in ("leak.txt", "up/secret.txt"):
        with pytest.raises(MediaError) as caught:
            read_local_media(reference, root, max_bytes=1024)
        assert caught.value.reason_code is Reason.PATH_ESCAPE


@pytest.mark.timeout(10)
def test_c2_fifo_under_the_root_is_refused_without_hanging(root: MediaRoot) -> None:
    os.mkfifo(root.canonical / "pipe.png")
    with pytest.raises(MediaError) as caught:
        read_local_media("pipe.png", root, max_bytes=1024)
    assert caught.value.reason_code is Reason.NOT_REGULAR_FILE


def test_c2_directories_and_missing_files(root: MediaRoot) -> None:
    with pytest.raises(MediaError) as caught:
        read_local_media("sub", root, max_bytes=1024)
    assert caught.value.reason_code is Reason.NOT_REGULAR_FILE
    with pytest.raises(MediaError) as caught:
        read_local_media("nope.png", root, max_bytes=1024)
    assert caught.value.reason_code is Reason.NOT_FOUND


def test_c2_last_component_swapped_for_a_symlink_is_not_followed(root: MediaRoot) -> None:
    path = resolve_local_path("cat.png", root)
    path.unlink()
    path.symlink_to(root.canonical.parent / "secret.txt")  # swapped in after the check
    with pytest.raises(MediaError) as caught:
        read_under_root(root, path, max_bytes=1024)
    assert caught.value.reason_code is Reason.NOT_REGULAR_FILE


def test_c2_directory_swapped_for_a_symlink_is_not_followed(root: MediaRoot, tmp_path: Path) -> None:
    path = resolve_local_path("sub/dog.png", root)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "dog.png").write_bytes(b"impostor")
    (root.canonical / "sub").rename(tmp_path / "old-sub")
    (root.canonical / "sub").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(MediaError) as caught:
        read_under_root(root, path, max_bytes=1024)
    assert caught.value.reason_code is Reason.NOT_REGULAR_FILE


def test_c4_local_file_over_the_cap_is_refused(root: MediaRoot) -> None:
    assert read_local_media("cat.png", root, max_bytes=len(CAT)) == CAT
    with pytest.raises(MediaError) as caught:
        read_local_media("cat.png", root, max_bytes=len(CAT) - 1)
    assert caught.value.reason_code is Reason.PAYLOAD_TOO_LARGE


def test_c2_media_root_must_be_an_existing_directory(tmp_path: Path) -> None:
    with pytest.raises(MediaConfigError, match="--media-path"):
        MediaRoot.open(tmp_path / "missing")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(MediaConfigError, match="--media-path"):
        MediaRoot.open(tmp_path / "file")
