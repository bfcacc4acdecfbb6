"""The routing key of a request (spec X): stickiness by conversation, else its prompt's text head.

Read from the request as received, before any adapter: `prompt_cache_key`, then the
`X-Conversation-Id` header, then `user` (Anthropic: `metadata.user_id`) make a request sticky;
the prefix is the text a prompt starts with (system prompt and messages in order, or the raw
prompt), which is what a replica's prefix cache will hold. A body that is not JSON routes by
load alone; nothing here ever raises.
"""

from __future__ import annotations

import json
from typing import Any

from mlxcel.cluster.prefix_tree import MAX_PREFIX_CHARS
from mlxcel.cluster.wire import Headers, RoutingKey

CONVERSATION_HEADER = b"x-conversation-id"
_SEPARATOR = "\x1e"  # between messages, so "ab" + "c" and "a" + "bc" differ


def routing_key(headers: Headers, body: bytes) -> RoutingKey:
    """The sticky key and text prefix of one request; empty when nothing identifies it."""
    fields = _json_object(body)
    header = next((value.decode("latin-1") for name, value in headers if name == CONVERSATION_HEADER), None)
    return RoutingKey(sticky=_sticky_key(fields, header), prefix=_prompt_prefix(fields))


def _json_object(body: bytes) -> dict[str, Any]:
    if not body or body[:1] not in (b"{", b" ", b"\n", b"\t", b"\r"):
        return {}
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _sticky_key(fields: dict[str, Any], header: str | None) -> str | None:
    extra = fields.get("extra_body") if isinstance(fields.get("extra_body"), dict) else {}
    metadata = fields.get("metadata") if isinstance(fields.get("metadata"), dict) else {}
    candidates = (("prompt_cache_key", fields.get("prompt_cache_key") or extra.get("prompt_cache_key")),
                  ("conversation", header), ("user", fields.get("user") or metadata.get("user_id")))
    for kind, value in candidates:
        if isinstance(value, str) and value:
            return f"{kind}:{value[:256]}"
    return None


def _prompt_prefix(fields: dict[str, Any]) -> str:
    parts: list[str] = []
    budget = MAX_PREFIX_CHARS
    for name in ("instructions", "system", "messages", "input", "prompt", "input_extra", "input_prefix"):
        if name in fields and budget > 0:
            budget = _collect_text(fields[name], parts, budget, 0)
    return _SEPARATOR.join(parts)[:MAX_PREFIX_CHARS]


def _collect_text(value: Any, parts: list[str], budget: int, depth: int) -> int:
    """Append strings in document order (content, text blocks, prompts; token ids as text); the budget left."""
    if depth > 8 or budget <= 0:
        return budget
    if isinstance(value, str):
        parts.append(value[:budget])
        return budget - len(parts[-1]) - 1
    if isinstance(value, int) and not isinstance(value, bool):
        parts.append(str(value))
        return budget - len(parts[-1]) - 1
    items: list[Any] = []
    if isinstance(value, list):
        items = value
    elif isinstance(value, dict):
        items = [value[key] for key in ("role", "content", "text", "input", "prompt") if key in value]
    for item in items:
        budget = _collect_text(item, parts, budget, depth + 1)
        if budget <= 0:
            break
    return budget
