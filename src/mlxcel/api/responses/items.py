"""Responses items: stored form, and the chat messages a template renders from them (F2).

Every item of a conversation (request input or model output) is kept as a plain JSON dict in
OpenAI's output shape, with an id, so it can be stored, listed by `input_items` and replayed
by `previous_response_id`. `to_chat_messages` turns a conversation into template messages:

    instructions + compaction summaries   -> one leading system message
    message (user/system/developer)        -> {"role": ..., "content": text}  (developer -> system)
    message (assistant) + reasoning        -> {"role": "assistant", "content", "reasoning_content"}
    function_call, custom_tool_call        -> tool_calls on the assistant message of that turn
                                              (names as the template saw them: responses/tools.py)
    function_call_output, custom_..._output -> {"role": "tool", "tool_call_id", "name", "content"}
    other documented items, as history       -> a hosted tool's `*_call` with a call_id (local_shell_call,
    (issue 46: never a 400)                     shell_call, apply_patch_call...) a tool call, its `*_output`
                                                a tool message; others (web_search_call, mcp_*) their text or
                                                action as the assistant's text; nothing to show: logged once

A reasoning item may come back with only its `encrypted_content` (`include:
["reasoning.encrypted_content"]` with `store: false`, as Codex sends every turn): here that is
the reasoning text in base64 with an integrity tag, not encryption; an opaque value this server
did not write (another provider's) is skipped.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import logging
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mlxcel.api.errors import invalid_request
from mlxcel.api.media import audio_data_url
from mlxcel.api.responses.schemas import (
    ITEM_MODELS, CustomToolCallItem, FunctionCallItem, FunctionCallOutputItem, InputItem,
    MessageItem, ReasoningItem,
)  # fmt: skip
from mlxcel.api.responses.tools import call_arguments
from mlxcel.media import MediaKind, MediaRef

log = logging.getLogger(__name__)
Item = dict[str, Any]
IdFactory = Callable[[str], str]
COMPACTION_HEADING = "Summary of the earlier conversation:"
ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs",
               "compaction": "cmp", "custom_tool_call": "ctc", "custom_tool_call_output": "ctco"}
SEAL_PREFIX = "mlxcel-reasoning-v1:"  # sealed reasoning: prefix, base64 of the UTF-8 text, ".", tag


def new_id(prefix: str) -> str:
    """An OpenAI-style id: `resp_…`, `msg_…`, `fc_…`."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- typed input items -> stored items ----

def stored_items(items: Iterable[InputItem], make_id: IdFactory = new_id) -> list[Item]:
    """Input items in their stored (output) shape, each with an id."""
    return [_stored(item, make_id) for item in items]


def _stored(item: InputItem, make_id: IdFactory) -> Item:
    data = item.model_dump(exclude_none=True)
    data["id"] = item.id or make_id(ID_PREFIXES.get(item.type, "item"))
    if isinstance(item, MessageItem):
        data["content"] = _message_parts(item)
        data["status"] = item.status or "completed"
    elif isinstance(item, FunctionCallItem | FunctionCallOutputItem | CustomToolCallItem):
        data["status"] = item.status or "completed"
    elif isinstance(item, ReasoningItem):
        data.setdefault("summary", [])
    return data


def _message_parts(item: MessageItem) -> list[dict[str, Any]]:
    kind = "output_text" if item.role == "assistant" else "input_text"
    if isinstance(item.content, str):
        parts = [{"type": kind, "text": item.content}]
    else:
        parts = [part.model_dump(exclude_none=True) for part in item.content]
    for part in parts:
        if part["type"] == "output_text":
            part.setdefault("annotations", [])
    return parts


def media_refs(items: Sequence[InputItem]) -> list[MediaRef]:
    """The media parts (input_image, input_audio) of the input, for the media layer to check, in the order the
    prompt renders them: message parts and a tool output's parts (issue 43: images in function_call_output)."""
    return stored_media_refs([item.model_dump(exclude_none=True) for item in items])


def stored_media_refs(conversation: Sequence[Item], where: str = "input") -> list[MediaRef]:
    """`media_refs` of items in their stored shape (a previous response's history: earlier turns' images
    reach the model again, as chat's image_url parts of earlier messages do)."""
    refs = []
    for i, item in enumerate(conversation):
        key = "content" if item["type"] == "message" else "output" if item["type"] in _TOOL_OUTPUTS else None
        parts = item.get(key) if key else None
        if isinstance(parts, list):
            refs += [_media_ref(f"{where}.{i}.{key}.{j}", part) for j, part in enumerate(parts)
                     if isinstance(part, dict) and part.get("type") in ("input_image", "input_audio")]
    return refs


_TOOL_OUTPUTS = ("function_call_output", "custom_tool_call_output")


def _media_ref(where: str, part: dict[str, Any]) -> MediaRef:
    if part["type"] == "input_audio":
        audio = part.get("input_audio") or {}
        if not isinstance(audio.get("data"), str) or not isinstance(audio.get("format"), str):
            raise invalid_request(f"{where}: input_audio needs input_audio.data and input_audio.format strings")
        return MediaRef(MediaKind.AUDIO, audio_data_url(audio["data"], audio["format"]))
    if not isinstance(part.get("image_url"), str) or not part["image_url"]:
        raise invalid_request(f"{where}: input_image needs an image_url (the Files API, file_id, is not "
                              "available on this server)")
    return MediaRef(MediaKind.IMAGE, part["image_url"])


# ---- stored items -> chat template messages ----

def to_chat_messages(instructions: str | None, conversation: Sequence[Item],
                     image_marker: str | None = None) -> list[dict[str, Any]]:
    """The template messages for a conversation; raises ApiError(400) for content a text model cannot read.
    With `image_marker` (a model that takes images, issue 43) an input_image part renders as that text."""
    builder = _ChatBuilder(image_marker)
    for index, item in enumerate(conversation):
        builder.add(index, item)
    preamble = [text for text in (instructions, *builder.summaries) if text]
    head = [{"role": "system", "content": "\n\n".join(preamble)}] if preamble else []
    return head + builder.messages


class _ChatBuilder:
    """Folds items into chat messages: reasoning waits for the assistant message it belongs to."""

    def __init__(self, image_marker: str | None = None) -> None:
        self.image_marker = image_marker
        self.messages: list[dict[str, Any]] = []
        self.summaries: list[str] = []
        self.pending_reasoning: list[str] = []
        self.call_names: dict[str, str] = {}

    def add(self, index: int, item: Item) -> None:
        kind = item["type"]
        if kind == "message":
            self._message(index, item)
        elif kind in ("function_call", "custom_tool_call"):
            self._function_call(item)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            self._function_output(index, item)
        elif kind == "reasoning" and (text := reasoning_text(item)):
            self.pending_reasoning.append(text)
        elif kind == "compaction":
            self.summaries.append(f"{COMPACTION_HEADING}\n{item['encrypted_content']}")
        elif kind not in ITEM_MODELS:
            self._other(index, item)

    def _other(self, index: int, item: Item) -> None:
        """A history-only item (issue 46): a hosted tool's call and its output as a call and its tool
        message, where it has a call_id; else its text as the assistant's; nothing to show: logged once."""
        kind, text = item["type"], other_item_text(index, item)
        if kind.endswith("_output") and isinstance(item.get("call_id"), str):
            self._function_output(index, {**item, "output": text})
        elif kind.endswith("_call") and isinstance(item.get("call_id"), str):
            name = item.get("name") if isinstance(item.get("name"), str) else kind.removesuffix("_call")
            arguments = item.get("arguments")
            self._function_call({"type": "function_call", "call_id": item["call_id"], "name": name,
                                 "arguments": arguments if isinstance(arguments, str) else _details_json(item)})
        elif text:
            message = self._assistant(for_calls=True)
            message["content"] = "\n".join(part for part in (message["content"], text) if part)
        else:
            note_unknown_item(kind)

    def _message(self, index: int, item: Item) -> None:
        text = parts_text(f"input.{index}", item["content"], self.image_marker)
        if item["role"] == "assistant":
            self._assistant(for_calls=False)["content"] = text
            return
        role = "system" if item["role"] == "developer" else item["role"]
        self.messages.append({"role": role, "content": text})

    def _assistant(self, *, for_calls: bool) -> dict[str, Any]:
        """A new assistant message, or for a call the current one when it has no calls' answers yet."""
        last = self.messages[-1] if self.messages else None
        if for_calls and last is not None and last["role"] == "assistant" and not self.pending_reasoning:
            return last
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        if self.pending_reasoning:
            message["reasoning_content"] = "\n".join(self.pending_reasoning)
            self.pending_reasoning = []
        self.messages.append(message)
        return message

    def _function_call(self, item: Item) -> None:
        message = self._assistant(for_calls=True)
        name, arguments = call_arguments(item)
        call = {"id": item["call_id"], "type": "function", "function": {"name": name, "arguments": arguments}}
        message.setdefault("tool_calls", []).append(call)
        self.call_names[item["call_id"]] = name

    def _function_output(self, index: int, item: Item) -> None:
        output = item["output"]
        text = output if isinstance(output, str) else parts_text(f"input.{index}.output", output, self.image_marker)
        message = {"role": "tool", "tool_call_id": item["call_id"], "content": text}
        if item["call_id"] in self.call_names:
            message["name"] = self.call_names[item["call_id"]]
        self.messages.append(message)


def other_item_text(index: int, item: Item) -> str:
    """What a history-only item says: its text or output, else its action / arguments / query as JSON."""
    for key in ("text", "output", "arguments", "input"):
        value = item.get(key)
        if isinstance(value, str):
            return value
        if key == "output" and isinstance(value, list):
            return parts_text(f"input.{index}.output", value)
    details = _details_json(item)
    return f"{item['type']}: {details}" if details != "{}" else ""


def _details_json(item: Item) -> str:
    """What a hosted tool's call did (its action, query, arguments or input), as a JSON object."""
    details = {key: item[key] for key in ("action", "query", "queries", "arguments", "input") if key in item}
    return json.dumps(details, ensure_ascii=False)


@functools.cache
def note_unknown_item(kind: str) -> None:
    """Log an item type with nothing to show, once per type for the process's life."""
    log.warning("responses: input items of type %r have no text; the prompt leaves them out", kind[:100])


def parts_text(where: str, parts: Sequence[dict[str, Any]], image_marker: str | None = None) -> str:
    """The text of content parts, joined by newlines; an image is `image_marker` where the model takes
    images; anything else but text is a 400 for a text model."""
    texts = []
    for j, part in enumerate(parts):
        kind = part["type"]
        if kind in ("input_text", "output_text"):
            texts.append(part["text"])
        elif kind == "refusal":
            texts.append(part["refusal"])
        elif kind == "input_image" and image_marker is not None:
            texts.append(image_marker)
        elif kind in ("input_image", "input_audio"):
            raise invalid_request(f"the served model does not accept {kind.removeprefix('input_')} input")
        else:
            raise invalid_request(f"{where}.content.{j}: content of type {kind!r} is not supported by this model "
                                  "(text only)")
    return "\n".join(texts)


def reasoning_text(item: Item) -> str:
    """A reasoning item's text: its reasoning_text content when present, else its summary, else
    what its encrypted_content carries (when this server wrote it)."""
    content = item.get("content") or item.get("summary") or []
    if not content and isinstance(item.get("encrypted_content"), str):
        return unseal_reasoning(item["encrypted_content"]) or ""
    return "\n".join(part["text"] for part in content)


def seal_reasoning(text: str) -> str:
    """The opaque `encrypted_content` of a reasoning item: the text in base64 and a SHA-256 tag that
    catches a damaged value (an integrity check, not secrecy: the client may read it)."""
    payload = base64.b64encode(text.encode()).decode()
    return f"{SEAL_PREFIX}{payload}.{_tag(payload)}"


def unseal_reasoning(value: str) -> str | None:
    """The text of a value seal_reasoning made; None for anything else (another server's, damaged)."""
    payload, _, tag = value.removeprefix(SEAL_PREFIX).rpartition(".")
    if not value.startswith(SEAL_PREFIX) or tag != _tag(payload):
        return None
    try:
        return base64.b64decode(payload, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


def _tag(payload: str) -> str:
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def conversation_turns(conversation: Sequence[Item]) -> tuple[list[Item], list[Item]]:
    """(older items, the last turn): the last turn starts at the last user message."""
    starts = [i for i, item in enumerate(conversation) if item["type"] == "message" and item["role"] == "user"]
    cut = starts[-1] if starts else len(conversation)
    return list(conversation[:cut]), list(conversation[cut:])


