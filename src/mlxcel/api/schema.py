"""Shared request-schema helpers: the strict pydantic base, body validation to 400 (D1), the extra_body rule.

Every protocol's request models derive from `WireModel`: JSON types are checked strictly (a
string is not a number), unknown fields are ignored, and a failed validation becomes an
`invalid_request_error` whose message is pydantic's, one line per field, cut to 1 KiB.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from mlxcel.api.errors import ApiError, invalid_request

M = TypeVar("M", bound=BaseModel)
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # the range torch.Generator.manual_seed accepts
# The roles a chat message may have (OpenAI's, plus llama-server's legacy "function"); others are a 400.
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class WireModel(BaseModel):
    """Base of request bodies and their parts: strict JSON types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class ChatFeatureFields(WireModel):
    """The chat-feature extension fields every chat-shaped body accepts, at the root or in
    extra_body. Typed `Any` where the chat features check the value with their own message."""

    chat_template_kwargs: Any = None  # S
    preserve_thinking: Any = None  # S: DashScope's flat form of the kwarg
    thinking_budget_tokens: Any = None  # R
    thinking_token_budget: Any = None  # R (vLLM)
    thinking_budget: Any = None  # R (Qwen)
    max_pattern_size: Any = None  # P
    min_pattern_size: Any = None  # P
    min_count: Any = None  # P
    json_schema: Any = None  # V (llama-server)
    grammar: Any = None  # V (llama-server GBNF)
    prompt_cache_key: Any = None  # Q session
    user: Any = None  # Q session
    cache_prompt: bool = True  # M


class LoraEntry(WireModel):
    """One item of a request's `lora` list or a POST /lora-adapters body (F8, llama-server's shape)."""

    id: int
    scale: float


def lora_pairs(entries: list[LoraEntry] | None) -> tuple[tuple[int, float], ...] | None:
    """(id, scale) pairs for GenerationParams.lora; None when the field was not given."""
    return None if entries is None else tuple((e.id, e.scale) for e in entries)


def validation_message(exc: ValidationError) -> str:
    """`field.path: message` for each error, as one line."""
    parts = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(p) for p in error["loc"]) or "body"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


def validate_body(model: type[M], body: Any) -> M:
    """Validate a parsed JSON body into `model`; raises ApiError(400) with pydantic's message."""
    if not isinstance(body, Mapping):
        raise invalid_request(f"the request body must be a JSON object, not {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid_request(validation_message(exc)) from None
    except ValueError as exc:  # a field validator's own message
        raise invalid_request(str(exc)) from None


def flatten_extra_body(body: Any) -> Any:
    """The one extra_body rule (spec M, S): lift fields nested in `extra_body` to the root.

    A field already at the root wins, except two chat-template fields: `chat_template_kwargs`
    objects in both places merge per key (the root's keys win), and DashScope's
    `preserve_thinking` in extra_body wins over the root copy the OpenAI SDK makes of it. The
    OpenAI SDK flattens `extra_body` itself, but clients that send it literally (vLLM-style)
    nest it, so `cache_prompt`, `top_k` and friends are honoured in both forms. Anything that
    is not an object is returned as is; a nested chat_template_kwargs that is not an object is
    a 400.
    """
    if not isinstance(body, Mapping) or not isinstance(body.get("extra_body"), Mapping):
        return body  # validate_body reports a non-object body; a bad extra_body fails its type
    extra = body["extra_body"]
    merged = {**extra, **body}
    merged.pop("extra_body", None)
    nested = extra.get("chat_template_kwargs")
    if nested is not None and not isinstance(nested, Mapping):
        raise invalid_request(f"extra_body.chat_template_kwargs must be a JSON object, not {type(nested).__name__}")
    root = body.get("chat_template_kwargs")
    if isinstance(nested, Mapping) and (root is None or isinstance(root, Mapping)):
        merged["chat_template_kwargs"] = {**nested, **(root or {})}
    if extra.get("preserve_thinking") is not None:
        merged["preserve_thinking"] = extra["preserve_thinking"]
    return merged


def require(condition: bool, message: str) -> None:
    """Raise a 400 invalid_request_error unless `condition` holds."""
    if not condition:
        raise invalid_request(message)


__all__ = ["MAX_SEED", "MIN_SEED", "ApiError", "ChatFeatureFields", "ChatRole", "WireModel", "flatten_extra_body",
           "require", "validate_body", "validation_message"]
