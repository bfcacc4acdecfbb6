"""Local media under `--media-path` (spec C2): `file://` URLs and bare names, sandboxed to one root.

A reference is refused on its text first (the forms the spec lists), then resolved under the
canonical root, then opened one component at a time from the root's directory descriptor with
O_NOFOLLOW, so a symlink swapped in after the check is never followed and a FIFO never blocks.
"""

from __future__ import annotations

import os
import re
import stat
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from mlxcel.media.errors import MediaConfigError, MediaError, Reason

MAX_PATH_BYTES = 255

_FORBIDDEN_CHARS = frozenset(':*?"<>|')
# Characters that render like a path separator but are not one; NFKC-derived dots and
# slashes are caught separately in `_look_alike`.
_LOOK_ALIKE_SEPARATORS = frozenset(
    "\u2044\u2215\uff0f\u29f8\u2571\u27cb\u1735\u3033\u0337\u0338"  # slash-like
    "\uff3c\u29f5\u29f9\u2216\ufe68\u2572\u27cd\u3035\u20e5"  # backslash-like
)
_ESCAPED_SEPARATOR = re.compile(r"%(2e|2f|5c|00)", re.IGNORECASE)
_READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class MediaRoot:
    """The `--media-path` directory: as configured, and canonical (symlinks resolved)."""

    configured: Path
    canonical: Path

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> MediaRoot:
        """Validate a `--media-path` value at startup; raises MediaConfigError naming the problem."""
        configured = Path(directory).expanduser().absolute()
        if not configured.is_dir():
            raise MediaConfigError(f"--media-path {str(directory)!r} is not an existing directory")
        return cls(configured=configured, canonical=configured.resolve(strict=True))

    def contains(self, path: Path) -> bool:
        """True if the canonical `path` is the canonical root or below it."""
        return path == self.canonical or self.canonical in path.parents


def read_local_media(reference: str, root: MediaRoot | None, max_bytes: int) -> bytes:
    """Read a `file://` URL or bare name from under `root`, at most `max_bytes` bytes.

    Raises MediaError for every refusal: no root configured, a rejected path form, a path
    outside the root, a missing file, anything but a regular file, or a file over the cap.
    """
    enabled_root = require_root(root)
    return read_under_root(enabled_root, resolve_local_path(reference, enabled_root), max_bytes)


def require_root(root: MediaRoot | None) -> MediaRoot:
    """The root, or the refusal every local reference gets when `--media-path` is not set."""
    if root is None:
        raise MediaError(
            "local media (file:// URLs and bare file names) is disabled; "
            "start the server with --media-path DIR to allow it",
            Reason.LOCAL_MEDIA_DISABLED,
        )
    return root


def resolve_local_path(reference: str, root: MediaRoot | None) -> Path:
    """Check a local reference and return its canonical path inside `root` (it exists)."""
    enabled_root = require_root(root)
    text = local_path_text(reference)
    check_path_text(text)
    return _canonical_inside(enabled_root, _candidate(enabled_root, text), text)


def local_path_text(reference: str) -> str:
    """The path a reference names: `file://cat.png` and `file:///srv/x.png` lose the scheme."""
    if reference[:5].lower() != "file:":
        return reference
    rest = reference[5:]
    rest = rest[2:] if rest.startswith("//") else rest
    if _ESCAPED_SEPARATOR.search(rest):
        raise _invalid(reference, "percent-escapes of '.', '/', '\\' or NUL are not allowed")
    try:
        return unquote(rest, errors="strict")
    except UnicodeDecodeError:
        raise _invalid(reference, "percent-escapes do not decode as UTF-8") from None


def check_path_text(text: str) -> None:
    """Refuse the path forms spec C2 lists before any filesystem access."""
    if not text:
        raise _invalid(text, "the path is empty")
    if len(text.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise _invalid(text, f"the path is longer than {MAX_PATH_BYTES} bytes")
    if _ESCAPED_SEPARATOR.search(text):
        raise _invalid(text, "percent-escapes of '.', '/', '\\' or NUL are not allowed")
    if ".." in text:
        raise _invalid(text, "'..' is not allowed")
    for char in text:
        _check_char(text, char)
    for component in text.split("/"):
        _check_component(text, component)


def _check_char(text: str, char: str) -> None:
    category = unicodedata.category(char)
    if category == "Cc":
        raise _invalid(text, f"control character U+{ord(char):04X} is not allowed")
    if category in ("Cf", "Cs"):
        raise _invalid(text, f"invisible format character U+{ord(char):04X} is not allowed")
    if char in _FORBIDDEN_CHARS:
        raise _invalid(text, f"character {char!r} is not allowed")
    if char == "\\":
        raise _invalid(text, "backslash is not a path separator here and is not allowed")
    if _look_alike(char):
        raise _invalid(text, f"U+{ord(char):04X} looks like a path separator or dot")


def _look_alike(char: str) -> bool:
    if char in _LOOK_ALIKE_SEPARATORS:
        return True
    # Compatibility forms such as U+FF0E or U+2025 normalise to '.', '..', '/' or '\'.
    return ord(char) > 0x7F and any(c in "./\\" for c in unicodedata.normalize("NFKC", char))


def _check_component(text: str, component: str) -> None:
    if not component:  # the empty pieces of a leading '/' or a doubled '//'
        return
    if component != component.strip():
        raise _invalid(text, "leading or trailing whitespace in a path component is not allowed")
    if component.endswith("."):
        raise _invalid(text, "a path component ending in '.' is not allowed")


def _candidate(root: MediaRoot, text: str) -> Path:
    # Relative paths resolve under the root; absolute ones must name a place inside it.
    path = Path(text)
    if not path.is_absolute():
        return root.canonical / path
    for base in (root.configured, root.canonical):
        if path == base or base in path.parents:
            return root.canonical / path.relative_to(base)
    raise MediaError(f"media path {text!r} is outside --media-path", Reason.PATH_ESCAPE)


def _canonical_inside(root: MediaRoot, candidate: Path, text: str) -> Path:
    try:
        canonical = candidate.resolve(strict=True)
    except FileNotFoundError:
        raise MediaError(f"media file {text!r} does not exist", Reason.NOT_FOUND) from None
    except (OSError, RuntimeError) as exc:  # symlink loops, permission on a parent
        raise MediaError(f"media path {text!r} cannot be resolved: {exc}", Reason.INVALID_PATH) from None
    if not root.contains(canonical):
        raise MediaError(
            f"media path {text!r} resolves outside --media-path (a symlink escapes the root)",
            Reason.PATH_ESCAPE,
        )
    return canonical


def read_under_root(root: MediaRoot, path: Path, max_bytes: int) -> bytes:
    """Open canonical `path` below `root` without following any symlink and read it, capped."""
    fd = _open_no_follow(root.canonical, path.relative_to(root.canonical).parts)
    try:
        _check_regular(fd, path, max_bytes)
        return _read_capped(fd, path, max_bytes)
    finally:
        os.close(fd)


def _open_no_follow(root: Path, parts: tuple[str, ...]) -> int:
    # Walk from the root's descriptor; O_NOFOLLOW on every component closes the swap window.
    if not parts:
        raise MediaError("the media root itself is not a file", Reason.NOT_REGULAR_FILE)
    dir_flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    file_flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    fd = os.open(root, dir_flags)
    try:
        for part in parts[:-1]:
            next_fd = _open_at(part, dir_flags, fd)
            os.close(fd)
            fd = next_fd
        return _open_at(parts[-1], file_flags, fd)
    finally:
        os.close(fd)


def _open_at(name: str, flags: int, dir_fd: int) -> int:
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        raise MediaError(
            f"media path component {name!r} cannot be opened safely ({exc.strerror}); "
            "symlinks swapped in after resolution are not followed",
            Reason.NOT_REGULAR_FILE,
        ) from None


def _check_regular(fd: int, path: Path, max_bytes: int) -> None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise MediaError(f"media path {path.name!r} is not a regular file", Reason.NOT_REGULAR_FILE)
    if info.st_size > max_bytes:
        raise MediaError(
            f"media file {path.name!r} is {info.st_size} bytes, over the {max_bytes}-byte limit",
            Reason.PAYLOAD_TOO_LARGE,
        )


def _read_capped(fd: int, path: Path, max_bytes: int) -> bytes:
    # The file may grow after fstat, so the cap is enforced on what is actually read.
    chunks: list[bytes] = []
    total = 0
    while chunk := os.read(fd, min(_READ_CHUNK, max_bytes + 1 - total)):
        chunks.append(chunk)
        total += len(chunk)
        if total > max_bytes:
            raise MediaError(
                f"media file {path.name!r} is over the {max_bytes}-byte limit", Reason.PAYLOAD_TOO_LARGE
            )
    return b"".join(chunks)


def _invalid(text: str, why: str) -> MediaError:
    shown = text if len(text) <= 80 else text[:77] + "..."
    return MediaError(f"media path {shown!r} is rejected: {why}", Reason.INVALID_PATH)
