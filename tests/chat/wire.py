"""Chat options from a JSON body, the way the adapters in api/ make them (the chat features'
unit tests state their cases as request bodies; the protocol edge turns them into ChatOptions)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlxcel.api.chat_options import read_chat_options
from mlxcel.api.schema import ChatFeatureFields, flatten_extra_body
from mlxcel.chat.options import ChatOptions, OutputConstraint


class AnyProtocolFields(ChatFeatureFields):
    """The chat-feature fields plus every protocol's output-format field and reasoning_effort."""

    response_format: Any = None  # OpenAI chat
    text: Any = None  # Responses: text.format
    output_format: Any = None  # Anthropic
    output_config: Any = None  # Anthropic: output_config.format
    reasoning_effort: str | None = None  # OpenAI chat


def chat_options(body: Mapping[str, Any], **choices: Any) -> ChatOptions:
    """`body`'s options (extra_body lifted); raises the chat features' REQUEST_ERRORS."""
    fields = AnyProtocolFields.model_validate(flatten_extra_body(body))
    return read_chat_options(fields, output=_formats(fields), reasoning_effort=fields.reasoning_effort, **choices)


def constraints(body: Mapping[str, Any]) -> tuple[OutputConstraint, ...]:
    return chat_options(body).output


def _formats(fields: AnyProtocolFields) -> list[tuple[str, Any]]:
    text, config = fields.text, fields.output_config
    return [
        ("response_format", fields.response_format),
        ("text.format", text.get("format") if isinstance(text, Mapping) else None),
        ("output_format", fields.output_format),
        ("output_config.format", config.get("format") if isinstance(config, Mapping) else None),
    ]
