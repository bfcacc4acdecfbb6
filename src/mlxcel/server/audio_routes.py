"""HTTP side of the audio routes (spec G): multipart uploads in, api.audio replies out.

The multipart body is parsed by Starlette (python-multipart) into plain values before anything
else; a body that is not multipart/form-data, or a broken one, is a 400 naming what to send.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request

from mlxcel.api import audio
from mlxcel.api.errors import invalid_request
from mlxcel.api.replies import Reply
from mlxcel.server.body import read_json, read_multipart
from mlxcel.server.state import ServerState


async def read_upload_form(request: Request, limits: audio.AudioLimits
                           ) -> tuple[dict[str, list[str]], audio.AudioUpload | None]:
    """The text fields and the `file` part of a multipart/form-data body; 400 otherwise."""
    fields, uploads = await read_multipart(
        request, expected="the audio as multipart/form-data with a 'file' part", max_files=1,
        read_file=lambda name, value: _read_file(name, value, limits))
    return fields, (uploads[0] if uploads else None)


async def _read_file(name: str, value: UploadFile, limits: audio.AudioLimits) -> audio.AudioUpload:
    if name != "file":
        raise invalid_request(f"unexpected file field {name!r}; upload the audio as 'file'")
    data = await value.read(limits.max_upload_bytes + 1)
    return audio.AudioUpload(value.filename or "file", value.content_type, data)


def _without(fields: dict[str, list[str]], names: Sequence[str]) -> dict[str, list[str]]:
    return {name: values for name, values in fields.items() if name not in names}


# Each returns the work still to do once the whole body is read and checked, so the caller can
# watch for a disconnect while it runs (nothing else may read the request's stream by then).

async def transcription_work(request: Request, state: ServerState, task: audio.Task
                             ) -> Coroutine[Any, Any, Reply]:
    limits = state.side.audio.limits if state.side.audio is not None else audio.AudioLimits()
    fields, upload = await read_upload_form(request, limits)  # D1: body errors before availability
    parsed = audio.parse_transcription_form(_without(fields, ("file",)), task)
    upload = audio.check_upload(upload, limits)
    transcriber = state.require_transcriber()
    return audio.transcribe(transcriber, parsed, upload, limits)


async def speech_work(request: Request, state: ServerState) -> Coroutine[Any, Any, Reply]:
    body = await read_json(request)
    synthesizer = state.require_synthesizer()
    return audio.speak(synthesizer, audio.parse_speech_request(body, synthesizer))
