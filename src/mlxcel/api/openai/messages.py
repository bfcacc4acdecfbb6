"""OpenAI-shaped chat messages in the chat template's dict form (OpenAI chat, llama-server /apply-template).

The messages keep their OpenAI shape (role, content, tool_calls, tool_call_id, reasoning_content);
only content given as an array of text parts is joined into one string, and two trailing
assistant turns are refused as llama-server refuses them. api/chat_prompt.py renders the result.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from mlxcel.api.errors import invalid_request


def template_messages(messages: Sequence[Mapping[str, Any]], image_marker: str | None = None,
                      video_frames: Sequence[int] = (), video_marker: str | None = None) -> list[dict[str, Any]]:
    """OpenAI-shaped dict messages in template form: an array of text parts becomes one string; with
    `image_marker` (a model that takes images, U) each `image_url` part becomes that placeholder text,
    and the i-th `video_url` part one marker per sampled frame (`video_frames[i]`, issue 43), or, for a
    model that takes videos as such (`video_marker`: Qwen2.5-VL's temporal patches), that marker once."""
    plain = []
    frames = iter(video_frames)
    for index, message in enumerate(messages):
        data = dict(message)
        if isinstance(data.get("content"), list):
            data["content"] = joined_text(f"messages.{index}.content", data["content"], image_marker, frames,
                                          video_marker)
        plain.append(data)
    if len(plain) >= 2 and all(m.get("role") == "assistant" for m in plain[-2:]):
        # llama-server's rule: one trailing assistant turn is a prefill; two cannot alternate.
        raise invalid_request("Cannot have 2 or more assistant messages at the end of the list.")
    return plain


def joined_text(where: str, parts: Sequence[Mapping[str, Any]], image_marker: str | None = None,
                frames: Iterator[int] = iter(()), video_marker: str | None = None) -> str:
    """Text-only models read an array of text parts as their texts joined by newlines (as vLLM)."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type")
        marker = {"image_url": image_marker, "video_url": video_marker}.get(str(kind))
        if marker is not None:
            texts.append(marker)
            continue
        if kind == "video_url" and image_marker is not None and (count := next(frames, None)) is not None:
            texts.extend([image_marker] * count)  # a video reaches the model as its frames
            continue
        if kind != "text" or not isinstance(part.get("text"), str):
            raise invalid_request(f"{where}.{j}: content of type {kind!r} is not supported by this model (text only)")
        texts.append(part["text"])
    return "\n".join(texts)
