"""POST /v1/messages/count_tokens (E1): the prompt token count a Messages call would have.

The same rendering as /v1/messages (system, blocks, tools, billing-stamp pin), without generating.
"""

from __future__ import annotations

from typing import Any

from mlxcel.api.anthropic.conversation import AnthropicOptions, render_prompt
from mlxcel.api.anthropic.schemas import CountTokensRequest
from mlxcel.api.context import ApiContext
from mlxcel.api.replies import JsonReply
from mlxcel.api.schema import flatten_extra_body, validate_body


def parse_count_tokens_request(body: Any) -> CountTokensRequest:
    """Validate like a Messages body, without max_tokens; raises ApiError(400) (D1)."""
    return validate_body(CountTokensRequest, flatten_extra_body(body))


async def count_message_tokens(ctx: ApiContext, req: CountTokensRequest, options: AnthropicOptions) -> JsonReply:
    """`{"input_tokens": N}` for the rendered prompt."""
    prompt = await render_prompt(ctx, req, options)
    return JsonReply({"input_tokens": len(prompt.token_ids)})
