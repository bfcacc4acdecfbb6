"""From a Responses request to prompt tokens (F2, F5): items, chaining, media check, template.

    conversation = history(previous_response_id) + stored_items(input)
    messages     = to_chat_messages(instructions, conversation)
    prompt       = template.render(messages, tools=...) -> token ids

Used the same way by create, input_tokens and compact, so `input_tokens` counts exactly the
prompt a create would run. With `truncation: "auto"` whole turns are dropped from the start
until the prompt fits the context; with "disabled" an oversized prompt is a 400 (as OpenAI).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlxcel.api.context import ApiContext
from mlxcel.api.errors import invalid_request
from mlxcel.api.generation import Prompt
from mlxcel.api.media import validate_media
from mlxcel.api.responses.items import Item, media_refs, stored_items, template_tools, to_chat_messages
from mlxcel.api.responses.schemas import ConversationFields, parse_input_items
from mlxcel.api.responses.service import ResponsesService
from mlxcel.text.chat_template import TemplateError

# Template variables the request sets through its own fields, never through chat_template_kwargs.
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                                     "continue_final_message"})


@dataclass(frozen=True, slots=True)
class PromptPlan:
    """The conversation a response continues (stored with it) and the prompt it renders to."""

    conversation: list[Item]
    prompt: Prompt


async def plan_prompt(ctx: ApiContext, service: ResponsesService, req: ConversationFields) -> PromptPlan:
    """Validate items and media, follow `previous_response_id`, render and tokenize; raises ApiError.

    Media parts are resolved under the server's policy first (a bad reference gets its own
    reason), then refused: the served model reads text only (api/media.py).
    """
    items = parse_input_items(req.input)
    await validate_media(ctx, media_refs(items))
    conversation = await service.history(req.previous_response_id) + stored_items(items)
    return render_conversation(ctx, req, conversation)


def render_conversation(ctx: ApiContext, req: ConversationFields, conversation: list[Item]) -> PromptPlan:
    """The prompt for `conversation`; with truncation "auto" the oldest turns go until it fits."""
    plan = PromptPlan(conversation, render_prompt(ctx, req, conversation))
    while req.truncation == "auto" and len(plan.prompt.token_ids) >= ctx.context_size:
        shorter = drop_first_turn(plan.conversation)
        if shorter is None:
            break  # one turn left: the engine's context error says how large it is
        plan = PromptPlan(shorter, render_prompt(ctx, req, shorter))
    return plan


def drop_first_turn(conversation: Sequence[Item]) -> list[Item] | None:
    """The conversation without its first turn (up to the second user message); None if one turn."""
    starts = [i for i, item in enumerate(conversation) if item["type"] == "message" and item["role"] == "user"]
    later = [i for i in starts if i > 0]
    return list(conversation[later[0]:]) if later else None


def render_prompt(ctx: ApiContext, req: ConversationFields, conversation: Sequence[Item]) -> Prompt:
    """Render the chat template (a failure is a 400, never a fallback) and tokenize the result."""
    if ctx.chat_template is None:
        raise invalid_request("this model has no chat template: start the server with --chat-template "
                              "or --chat-template-file, or use /v1/completions")
    messages = to_chat_messages(req.instructions, conversation)
    kwargs = template_kwargs(req)
    try:
        text = ctx.chat_template.render(messages, add_generation_prompt=True, tools=template_tools(req.tools),
                                        **kwargs)
    except TemplateError as exc:
        raise invalid_request(f"the chat template could not render these messages: {exc}") from None
    return Prompt(tuple(ctx.tokenizer.encode(text, add_special_tokens=False)), text)


def template_kwargs(req: ConversationFields) -> dict[str, Any]:
    kwargs = req.chat_template_kwargs or {}
    reserved = sorted(RESERVED_TEMPLATE_NAMES.intersection(kwargs))
    if reserved:
        raise invalid_request(f"chat_template_kwargs: {', '.join(reserved)} cannot be set here")
    return dict(kwargs)
