"""OpenAI chat content parts that carry media (C2-C5) as protocol-neutral `MediaRef`s.

`image_url` ({url} or a URL string), `input_audio` ({data, format}, read as a data: URL) and
`video_url` ({url, fps?} or a URL string), in message order; `api.media.validate_media`
then resolves and checks them.
"""

from __future__ import annotations

from mlxcel.api.errors import invalid_request
from mlxcel.api.media import audio_data_url
from mlxcel.api.openai.schemas import ChatCompletionRequest, ContentPart, MediaUrl
from mlxcel.media import MediaKind, MediaRef

MEDIA_PART_TYPES = {"image_url": MediaKind.IMAGE, "input_audio": MediaKind.AUDIO, "video_url": MediaKind.VIDEO}


def media_refs(req: ChatCompletionRequest) -> list[MediaRef]:
    """Every media part of every message, in order; a malformed part is a 400 naming its place."""
    refs = []
    for i, message in enumerate(req.messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if part.type in MEDIA_PART_TYPES:
                refs.append(_media_ref(part, f"messages.{i}.content.{j}"))
    return refs


def _media_ref(part: ContentPart, where: str) -> MediaRef:
    kind = MEDIA_PART_TYPES[part.type]
    if kind is MediaKind.AUDIO:
        if part.input_audio is None:
            raise invalid_request(f"{where}: an input_audio part needs input_audio: {{data, format}}")
        return MediaRef(kind, audio_data_url(part.input_audio.data, part.input_audio.format))
    value = part.image_url if kind is MediaKind.IMAGE else part.video_url
    if value is None:
        raise invalid_request(f"{where}: a {part.type} part needs {part.type}: {{url}}")
    if isinstance(value, MediaUrl):
        return MediaRef(kind, value.url, value.fps if kind is MediaKind.VIDEO else None)
    return MediaRef(kind, value)
