"""OpenAI Responses adapter (F2, F5): its own translation to the internal request and back.

Routes that read a body are two steps, so the server answers body errors before availability
(D1): `parse_*_request(body)` (400 on bad fields), then the call with the API context. The
server holds one `ResponsesService` (the SQLite store plus background runs) for all of them.
"""

from mlxcel.api.responses.compact import compact_response, parse_compact_request
from mlxcel.api.responses.create import (
    cancel_response, count_input_tokens, create_response, delete_response, list_input_items,
    parse_create_request, parse_input_tokens_request, retrieve_response,
)  # fmt: skip
from mlxcel.api.responses.service import ResponsesService

__all__ = [
    "ResponsesService", "cancel_response", "compact_response", "count_input_tokens", "create_response",
    "delete_response", "list_input_items", "parse_compact_request", "parse_create_request",
    "parse_input_tokens_request", "retrieve_response",
]
