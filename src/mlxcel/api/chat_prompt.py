"""A conversation rendered into the prompt the model sees: the one renderer every chat-shaped route uses.

OpenAI chat and llama-server `/apply-template` (api/openai/messages.py), Anthropic Messages and
Responses each turn their wire messages into the template's dict form (role, content text,
tool_calls, tool_call_id, reasoning_content); the chat features' `render_plan` then calls
`render_chat_prompt` (`/apply-template` `render_chat_text`), so `/apply-template` returns exactly
the text chat would generate from (F4). A template that cannot render is a 400, never a fallback.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mlxcel.api.context import ApiContext
from mlxcel.api.errors import invalid_request
from mlxcel.api.generation import Prompt
from mlxcel.text.chat_template import TemplateError

# Template variables the request sets through its own fields, never through chat_template_kwargs.
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                                     "continue_final_message"})


def render_chat_text(ctx: ApiContext, messages: Sequence[Mapping[str, Any]], *,
                     tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
                     continue_final_message: bool = False,
                     template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The prompt text for template-form `messages`; raises ApiError(400) when it cannot render."""
    if ctx.chat_template is None:
        raise invalid_request("this model has no chat template: start the server with --chat-template "
                              "or --chat-template-file, or send a raw prompt to /v1/completions")
    kwargs = dict(template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_NAMES.intersection(kwargs))
    if reserved:
        raise invalid_request(f"chat_template_kwargs: {', '.join(reserved)} cannot be set here")
    try:
        return ctx.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                        continue_final_message=continue_final_message, **kwargs)
    except TemplateError as exc:
        raise invalid_request(f"the chat template could not render these messages: {exc}") from None


def render_chat_prompt(ctx: ApiContext, messages: Sequence[Mapping[str, Any]], *,
                       tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
                       continue_final_message: bool = False,
                       template_kwargs: Mapping[str, Any] | None = None) -> Prompt:
    """`render_chat_text`, tokenized as is (the rendered text carries its own BOS)."""
    text = render_chat_text(ctx, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                            continue_final_message=continue_final_message, template_kwargs=template_kwargs)
    return Prompt(tuple(ctx.tokenizer.encode(text, add_special_tokens=False)), text)
