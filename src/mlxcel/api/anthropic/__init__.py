"""Anthropic Messages protocol adapter (E1, E2): /v1/messages and /v1/messages/count_tokens.

A sibling of the OpenAI adapter, never built on it (DESIGN.md rule 1). Each route is two steps,
so body errors are answered before availability (D1): `parse_*_request(body)`, then the call.
"""

from mlxcel.api.anthropic.conversation import AnthropicOptions
from mlxcel.api.anthropic.count_tokens import count_message_tokens, parse_count_tokens_request
from mlxcel.api.anthropic.messages import create_message, parse_messages_request

__all__ = [
    "AnthropicOptions", "count_message_tokens", "create_message", "parse_count_tokens_request",
    "parse_messages_request",
]
