"""Reasoning echo (spec Q): give back the reasoning a client dropped from its own history.

Clients such as the OpenAI SDK send earlier assistant turns back with their content only. Some
templates render a turn differently with and without its reasoning, so the follow-up prompt
would differ from the one generated from and miss the prefix cache. After each plain (not
tool-call) answer the route remembers its reasoning; before rendering a later request it puts
the reasoning back into assistant turns that carry content but no reasoning.

The key is a SHA-256 over the model, the template signature (template, kwargs, tools), the
session (`ChatOptions.session`, its adapter's key), the messages before the turn and the turn's content;
only the 32-byte key and the reasoning text are stored. LRU, bounded by bytes (16 MiB,
MLXCEL_REASONING_ECHO_MAX_BYTES; 0 disables) and by entries (4096); emptied on restart.
Not consulted with cache_prompt false, --reasoning-format none or deepseek-legacy, or
--skip-chat-parsing (`echo_applies`).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from mlxcel.chat.reasoning import ReasoningFormat

DEFAULT_MAX_BYTES = 16 << 20
DEFAULT_MAX_ENTRIES = 4096
KEY_BYTES = 32
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
# The parts of a message that identify it; anything else (refusal: null, ids...) is ignored.
_IDENTITY_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")


def echo_applies(*, cache_prompt: bool, reasoning_format: ReasoningFormat, skip_chat_parsing: bool) -> bool:
    """Whether a request may use the echo store at all (remember and restore alike)."""
    legacy_or_off = reasoning_format in (ReasoningFormat.NONE, ReasoningFormat.DEEPSEEK_LEGACY)
    return cache_prompt and not legacy_or_off and not skip_chat_parsing


def template_signature(template_source: str, kwargs: Mapping[str, Any], tools: Sequence[Any] | None) -> str:
    """What of the rendering setup must match: the template, its kwargs and the tools."""
    payload = json.dumps([template_source, kwargs, tools or []], sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


class ReasoningEcho:
    """The LRU store; safe to share between threads."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_bytes < 0 or max_entries < 0:
            raise ValueError("MLXCEL_REASONING_ECHO_MAX_BYTES and the entry limit must be 0 or more")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, str] = OrderedDict()
        self._num_bytes = 0
        self._lock = threading.Lock()

    @property
    def is_enabled(self) -> bool:
        return self.max_bytes > 0 and self.max_entries > 0

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        """Bytes held: per entry, its key and its reasoning's UTF-8 size."""
        return self._num_bytes

    def remember(
        self, *, model: str, signature: str, session: str,
        messages: Sequence[Mapping[str, Any]], content: str, reasoning: str,
    ) -> None:
        """After a plain answer: `messages` as the client sent them, the answer's content and
        its reasoning. Nothing is stored for an empty reasoning or content."""
        if not self.is_enabled or not reasoning or not content:
            return
        key = _key(model, signature, session, messages, content)
        size = KEY_BYTES + len(reasoning.encode("utf-8"))
        if size > self.max_bytes:
            return
        with self._lock:
            self._discard(key)
            self._entries[key] = reasoning
            self._num_bytes += size
            self._evict()

    def restore(
        self, messages: Sequence[Mapping[str, Any]], *, model: str, signature: str, session: str,
    ) -> list[dict[str, Any]]:
        """`messages` (copies) with remembered reasoning put back as `reasoning_content` into
        assistant turns that have content, no tool calls and no reasoning of their own."""
        restored = [dict(m) for m in messages]
        if not self.is_enabled:
            return restored
        for i, message in enumerate(messages):
            content = _echo_content(message)
            if content is None:
                continue
            reasoning = self._get(_key(model, signature, session, messages[:i], content))
            if reasoning is not None:
                restored[i]["reasoning_content"] = reasoning
        return restored

    def _get(self, key: bytes) -> str | None:
        with self._lock:
            reasoning = self._entries.get(key)
            if reasoning is not None:
                self._entries.move_to_end(key)
            return reasoning

    def _discard(self, key: bytes) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._num_bytes -= KEY_BYTES + len(old.encode("utf-8"))

    def _evict(self) -> None:
        while self._entries and (self._num_bytes > self.max_bytes or len(self._entries) > self.max_entries):
            self._discard(next(iter(self._entries)))


def _echo_content(message: Mapping[str, Any]) -> str | None:
    """The content of an assistant turn that may receive reasoning, else None."""
    if message.get("role") != "assistant" or message.get("tool_calls"):
        return None
    if any(message.get(f) for f in REASONING_FIELDS):
        return None  # the client's own reasoning always wins
    content = _text(message.get("content"))
    return content or None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return ""


def _key(model: str, signature: str, session: str, prior: Sequence[Mapping[str, Any]], content: str) -> bytes:
    identity = [{f: _identity_value(m, f) for f in _IDENTITY_FIELDS if m.get(f) is not None} for m in prior]
    payload = json.dumps([model, signature, session, identity, content], sort_keys=True, ensure_ascii=False,
                         default=str)
    return hashlib.sha256(payload.encode("utf-8")).digest()


def _identity_value(message: Mapping[str, Any], field: str) -> Any:
    # Text-only content as one string, so a string and the same text in parts key alike.
    value = message.get(field)
    if field == "content" and isinstance(value, list) and all(
        isinstance(p, Mapping) and p.get("type") == "text" for p in value
    ):
        return _text(value)
    return value
