"""Errors the media layer raises: one request-level type the HTTP layer maps to a 400, one startup type."""

from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    """Machine-readable reason codes carried by `MediaError`; the HTTP layer puts them in the 400 body."""

    LOCAL_MEDIA_DISABLED = "local_media_disabled"
    INVALID_PATH = "invalid_media_path"
    PATH_ESCAPE = "media_path_escape"
    NOT_FOUND = "media_not_found"
    NOT_REGULAR_FILE = "media_not_regular_file"
    VIDEO_DIR_NOT_ALLOWED = "video_dir_not_allowed"
    UNSUPPORTED_SCHEME = "unsupported_url_scheme"
    INVALID_URL = "invalid_media_url"
    URL_CREDENTIALS = "url_credentials"
    BLOCKED_ADDRESS = "blocked_address"
    UNRESOLVABLE_HOST = "unresolvable_host"
    TOO_MANY_REDIRECTS = "too_many_redirects"
    FETCH_TIMEOUT = "fetch_timeout"
    FETCH_FAILED = "fetch_failed"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    INVALID_DATA_URL = "invalid_data_url"
    TOO_MANY_IMAGES = "too_many_images"
    IMAGE_TOO_LARGE = "image_too_large"
    INVALID_IMAGE = "invalid_image"
    INVALID_VIDEO = "invalid_video"
    INVALID_MEDIA_PART = "invalid_media_part"


class MediaError(Exception):
    """A media reference was refused; `message` is the text for the 400, `reason_code` names the rule."""

    def __init__(self, message: str, reason_code: Reason) -> None:
        super().__init__(message)
        self.message = message
        self.reason_code = reason_code

    def __str__(self) -> str:
        return f"{self.message} [{self.reason_code.value}]"


class MediaConfigError(ValueError):
    """A media option or MLXCEL_* variable is invalid; raised at startup, the message names the option."""
