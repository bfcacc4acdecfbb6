"""Anthropic messages in the chat template's form (E1, E2), rendered by the shared chat renderer.

- `system` (a string or text blocks, joined by newlines) becomes a leading system message; a
  billing stamp there is pinned first (E2) unless the server turned that off. A `system` message
  in `messages` (text only; Claude Code sends one) stays a system message where it stood.
- user text blocks join into one user message; each `tool_result` becomes a `tool` message
  (`tool_call_id` = its `tool_use_id`), placed where it stood. Blocks with no chat field of their
  own (tool_reference, search_result, document, web search history, unknown types) are read as
  text (blocks.py, issue 46), never refused.
- assistant text joins into `content`, `thinking` blocks into `reasoning_content`, and
  `tool_use` blocks into `tool_calls` (arguments as an object, as chat templates read them).
- `tools` become OpenAI-style function definitions, the shape templates are written for.
- image blocks pass the media checks (C2-C5); a vision-language model (issue 43) takes them, rendered as its
  image marker in block order; a text-only model refuses them (400).

`chat_options` turns the request's fields into its options: `thinking` sets the template's
`enable_thinking` (and `budget_tokens` the reasoning budget, R), `tool_choice` auto/any/tool/none
(any and a named tool by constrained decoding, V), `output_config.format` / `output_format` a
JSON schema (V); reasoning is remembered for the echo only when thinking is shown (Q); a Messages
call's temperature, top_p, top_k and max_tokens are its sampling.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mlxcel.api import chat_features
from mlxcel.api.chat_options import budget_fields, build_chat_options, request_template_kwargs
from mlxcel.api.anthropic import billing
from mlxcel.api.anthropic.blocks import block_text, blocks_text
from mlxcel.api.anthropic.schemas import (
    ConversationFields, ImageBlock, Message, MessagesRequest, TextBlock, ThinkingBlock, Tool,
    ToolResultBlock, ToolUseBlock,
)  # fmt: skip
from mlxcel.api.context import ApiContext, SamplingDefaults
from mlxcel.api.errors import invalid_request
from mlxcel.api.generation import Prompt
from mlxcel.api.media import base64_data_url, validate_media, with_images
from mlxcel.media import MediaKind, MediaRef, ResolvedMedia
from mlxcel.chat.options import ChatOptions
from mlxcel.chat.plan import ChatPlan
from mlxcel.chat.template_kwargs import TemplateKwargsError
from mlxcel.types import SamplingParams

@dataclass(frozen=True, slots=True)
class AnthropicOptions:
    """Server-wide settings of the Anthropic routes, read once at startup."""

    pin_billing_stamp: bool = True  # MLXCEL_ANTHROPIC_PIN_BILLING_STAMP (E2)


async def render_prompt(ctx: ApiContext, req: ConversationFields, options: AnthropicOptions) -> Prompt:
    """The tokenized prompt for `req`; raises ApiError(400) for images and templates that fail."""
    return (await prepare_prompt(ctx, req, options))[1]


async def prepare_prompt(ctx: ApiContext, req: ConversationFields,
                         options: AnthropicOptions) -> tuple[ChatPlan, Prompt]:
    """The request's chat plan and tokenized prompt; raises ApiError(400) for images, invalid
    chat-feature fields and templates that fail."""
    media = await checked_images(ctx, req)
    messages = template_messages(req, pin_billing_stamp=options.pin_billing_stamp,
                                 image_marker=ctx.image_marker if media else None)
    plan = chat_features.plan_chat(ctx, chat_options(req, ctx.sampling), messages)
    return plan, await with_images(ctx, chat_features.render_plan(ctx, plan), media)


def chat_options(req: ConversationFields, defaults: SamplingDefaults = SamplingDefaults()) -> ChatOptions:
    """The request's options, decided here once: `thinking` as the template's `enable_thinking` (an
    explicit chat_template_kwargs key wins), an enabled thinking's `budget_tokens` as the
    reasoning budget (an explicit thinking_budget_tokens wins), and a Messages call's sampling
    (a token count has none; `defaults`: the server's, for what it leaves out); raises ApiError(400)."""
    choice = req.tool_choice
    output = [("output_format", req.output_format),
              ("output_config.format", req.output_config.format if req.output_config else None)]
    return build_chat_options(
        req, sampling=sampling_params(req, defaults) if isinstance(req, MessagesRequest) else None, output=output,
        tools=template_tools(req.tools), tool_choice=choice.model_dump(exclude_none=True) if choice else None,
        parallel_tool_calls=not (choice and choice.disable_parallel_tool_use),
        template_kwargs=_thinking_kwargs(req), budget=_thinking_budget(req), remembers_reasoning=req.shows_thinking)


def sampling_params(req: MessagesRequest, defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
    """Messages names temperature, top_p and top_k; the server's defaults fill those it leaves out and the
    fields it has no name for (min_p, the penalties)."""
    return SamplingParams(
        temperature=defaults.pick("temperature", req.temperature),
        top_p=defaults.pick("top_p", req.top_p), top_k=max(defaults.pick("top_k", req.top_k), 0),
        **defaults.params("min_p", "repeat_penalty", "presence_penalty", "frequency_penalty", "repeat_last_n"),
        max_tokens=req.max_tokens)


def _thinking_kwargs(req: ConversationFields) -> dict[str, Any] | None:
    """The request's template kwargs with `enable_thinking` from `thinking`; None without it."""
    if req.thinking is None:
        return None
    try:
        return {"enable_thinking": req.shows_thinking, **request_template_kwargs(req)}
    except TemplateKwargsError as exc:
        raise invalid_request(str(exc)) from None


def _thinking_budget(req: ConversationFields) -> list[tuple[str, Any]] | None:
    """The budget fields with an enabled thinking's `budget_tokens` second (after an explicit
    thinking_budget_tokens); None when thinking sets no budget."""
    thinking = req.thinking
    if thinking is None or thinking.type != "enabled" or thinking.budget_tokens is None:
        return None
    first, *aliases = budget_fields(req)
    return [first, ("thinking_budget_tokens", thinking.budget_tokens), *aliases]


def template_messages(req: ConversationFields, *, pin_billing_stamp: bool,
                      image_marker: str | None = None) -> list[dict[str, Any]]:
    """The conversation as template messages; with `image_marker` (a model that takes images, issue 43)
    each image block of a user turn renders as that text, in block order."""
    messages: list[dict[str, Any]] = []
    system = system_text(req.system, pin_billing_stamp=pin_billing_stamp)
    if system is not None:
        messages.append({"role": "system", "content": system})
    for message in req.messages:
        if message.role == "system":
            messages.append({"role": "system", "content": system_text(message.content, pin_billing_stamp=False)})
        else:
            messages.extend(_user_turn(message, image_marker) if message.role == "user"
                            else [_assistant_turn(message)])
    return messages


def system_text(system: str | Sequence[Any] | None, *, pin_billing_stamp: bool) -> str | None:
    """The text of the `system` field or of a system message (text blocks only, checked by the schema)."""
    if system is None:
        return None
    texts = [system] if isinstance(system, str) else [block.text for block in system]
    if pin_billing_stamp:
        texts = [billing.pin_billing_stamp(t) for t in texts]
    return "\n".join(texts)


def template_tools(tools: Sequence[Tool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}} for t in tools]


def _user_turn(message: Message, image_marker: str | None = None) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    turns: list[dict[str, Any]] = []
    texts: list[str] = []
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            turns.append({"role": "tool", "tool_call_id": block.tool_use_id,
                          "content": _tool_result_text(block, image_marker)})
        elif isinstance(block, ImageBlock) and image_marker is not None:
            texts.append(image_marker)
        elif (text := block_text(block)) is not None:
            texts.append(text)
    if texts or not turns:
        turns.append({"role": "user", "content": "\n".join(texts)})
    return turns


def _tool_result_text(block: ToolResultBlock, image_marker: str | None = None) -> str:
    """The tool result's text; with `image_marker` its image blocks render as that text (issue 43)."""
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    if image_marker is None:
        return blocks_text(block.content)
    texts = [image_marker if isinstance(part, ImageBlock) else block_text(part) for part in block.content]
    return "\n".join(text for text in texts if text)


def _assistant_turn(message: Message) -> dict[str, Any]:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts = [text for text in map(block_text, message.content) if text is not None]
    thinking = [b.thinking for b in message.content if isinstance(b, ThinkingBlock)]
    calls = [_tool_call(b) for b in message.content if isinstance(b, ToolUseBlock)]
    turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if thinking:
        turn["reasoning_content"] = "\n".join(thinking)
    if calls:
        turn["tool_calls"] = calls
    return turn


def _tool_call(block: ToolUseBlock) -> dict[str, Any]:
    return {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}}


def tool_use_input(arguments: str) -> dict[str, Any]:
    """A finished tool call's arguments JSON as the `input` object of a tool_use block."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


# ---- images (C2-C5) ----

async def checked_images(ctx: ApiContext, req: ConversationFields) -> list[ResolvedMedia]:
    """Validate every image the way any media part is validated; a text-only model then refuses them (400)."""
    refs = [MediaRef(MediaKind.IMAGE, _image_url(block)) for block in _image_blocks(req.messages)]
    return await validate_media(ctx, refs, takes_images=True)


def _image_blocks(messages: Sequence[Message]) -> Iterator[ImageBlock]:
    """Every image block in the order the prompt renders them: a user message's tool results (its tool turns,
    `_user_turn`) before its own blocks."""
    for message in messages:
        blocks = message.content if isinstance(message.content, list) else []
        for block in blocks:
            if isinstance(block, ToolResultBlock) and isinstance(block.content, list):
                yield from (part for part in block.content if isinstance(part, ImageBlock))
        yield from (block for block in blocks if isinstance(block, ImageBlock))


def _image_url(block: ImageBlock) -> str:
    source = block.source
    if source.type == "base64":
        assert source.media_type is not None and source.data is not None
        return base64_data_url(source.media_type, source.data)
    assert source.url is not None
    return source.url


__all__ = ["AnthropicOptions", "chat_options", "prepare_prompt", "render_prompt", "system_text",
           "template_messages", "template_tools", "tool_use_input"]
