"""From a Responses request to prompt tokens (F2, F5): items, chaining, media check, template.

    conversation = history(previous_response_id) + stored_items(input)
    messages     = to_chat_messages(instructions, conversation)
    prompt       = template.render(messages, tools=...) -> token ids

Used the same way by create, input_tokens and compact, so `input_tokens` counts exactly the
prompt a create would run. The request's `ChatOptions` (chat_options: its sampling and chat
features) are read here once; the chat features plan each render (api/chat_features.py): template
kwargs, reasoning echo into assistant turns, tools and tool_choice, `text.format`, budget. With
`truncation: "auto"` whole turns are dropped from the start until the prompt fits the context;
with "disabled" an oversized prompt is a 400 (as OpenAI).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from mlxcel.api import chat_features
from mlxcel.api.chat_options import build_chat_options
from mlxcel.api.context import ApiContext, SamplingDefaults
from mlxcel.api.generation import Prompt
from mlxcel.api.media import validate_media, with_images
from mlxcel.api.responses.items import Item, media_refs, stored_items, stored_media_refs, to_chat_messages
from mlxcel.api.responses.schemas import ConversationFields, ResponseCreateRequest, parse_input_items
from mlxcel.api.responses.service import ResponsesService
from mlxcel.api.responses.tools import parse_tools, template_tool_choice
from mlxcel.chat.options import ChatOptions
from mlxcel.chat.plan import ChatPlan
from mlxcel.types import SamplingParams



@dataclass(frozen=True, slots=True)
class PromptPlan:
    """The conversation a response continues (stored with it), the prompt it renders to and the
    chat features' plan for it (processors, output parser, echo)."""

    conversation: list[Item]
    prompt: Prompt
    chat: ChatPlan


async def plan_prompt(ctx: ApiContext, service: ResponsesService, req: ConversationFields) -> PromptPlan:
    """Validate items and media, follow `previous_response_id`, render and tokenize; raises ApiError.

    Media parts (the history's too) are resolved under the server's policy first (a bad reference gets
    its own reason), then refused where the served model reads text only, else processed (api/media.py).
    """
    items = parse_input_items(req.input)
    refs = media_refs(items)  # a malformed part of the input: a 400 naming it, before the history is read
    history = await service.history(req.previous_response_id)
    # issue 43: earlier turns' images (previous_response_id) reach the model again, before this input's
    media = await validate_media(ctx, stored_media_refs(history, "previous_response_id") + refs, takes_images=True)
    conversation = history + stored_items(items)
    plan = render_conversation(ctx, req, conversation, has_images=bool(media))
    return replace(plan, prompt=await with_images(ctx, plan.prompt, media)) if media else plan


def render_conversation(ctx: ApiContext, req: ConversationFields, conversation: list[Item], *,
                        has_images: bool = False) -> PromptPlan:
    """The prompt for `conversation`; with truncation "auto" the oldest turns go until it fits (not
    with images: their tokens are counted only once they are processed)."""
    plan = PromptPlan(conversation, *plan_render(ctx, req, conversation, has_images=has_images))
    while req.truncation == "auto" and not has_images and len(plan.prompt.token_ids) >= ctx.context_size:
        shorter = drop_first_turn(plan.conversation)
        if shorter is None:
            break  # one turn left: the engine's context error says how large it is
        plan = PromptPlan(shorter, *plan_render(ctx, req, shorter))
    return plan


def drop_first_turn(conversation: Sequence[Item]) -> list[Item] | None:
    """The conversation without its first turn (up to the second user message); None if one turn."""
    starts = [i for i, item in enumerate(conversation) if item["type"] == "message" and item["role"] == "user"]
    later = [i for i in starts if i > 0]
    return list(conversation[later[0]:]) if later else None


def render_prompt(ctx: ApiContext, req: ConversationFields, conversation: Sequence[Item]) -> Prompt:
    """Render the chat template (a failure is a 400, never a fallback) and tokenize the result."""
    return plan_render(ctx, req, conversation)[0]


def plan_render(ctx: ApiContext, req: ConversationFields, conversation: Sequence[Item], *,
                has_images: bool = False) -> tuple[Prompt, ChatPlan]:
    """Plan the chat features and render the chat template (a failure of either is a 400, never a
    fallback); the tokenized prompt and the plan."""
    messages = to_chat_messages(req.instructions, conversation, ctx.image_marker if has_images else None)
    plan = chat_features.plan_chat(ctx, chat_options(req, ctx.sampling), messages)
    return chat_features.render_plan(ctx, plan), plan


def chat_options(req: ConversationFields, defaults: SamplingDefaults = SamplingDefaults()) -> ChatOptions:
    """The request's options, decided here once: its chat features (`text.format` the output
    constraint) and, for a create, its sampling (an input-token count has none); raises ApiError(400)."""
    text_format = req.text.format if req.text else None
    output = [("text.format", text_format.model_dump(exclude_none=True, by_alias=True) if text_format else None)]
    tools = parse_tools(req.tools)
    return build_chat_options(
        req, sampling=sampling_params(req, defaults) if isinstance(req, ResponseCreateRequest) else None, output=output,
        tools=tools.template or None, tool_choice=template_tool_choice(req.tool_choice, tools),
        parallel_tool_calls=req.parallel_tool_calls)


def sampling_params(req: ResponseCreateRequest, defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
    """Sampling and limits of a create (OpenAI names, then llama/vLLM extras); the server's `defaults`
    fill the fields it leaves out or has no name for (repeat_last_n)."""
    return SamplingParams(
        temperature=defaults.pick("temperature", req.temperature),
        top_k=max(defaults.pick("top_k", req.top_k), 0),
        top_p=defaults.pick("top_p", req.top_p),
        min_p=defaults.pick("min_p", req.min_p),
        repetition_penalty=defaults.pick("repeat_penalty", req.repetition_penalty),
        presence_penalty=defaults.pick("presence_penalty", req.presence_penalty),
        frequency_penalty=defaults.pick("frequency_penalty", req.frequency_penalty),
        **defaults.params("repeat_last_n"),
        seed=req.seed,
        max_tokens=req.max_output_tokens,
        ignore_eos=req.ignore_eos,
        logprobs=(req.top_logprobs or 0) if req.wants_logprobs else None,
    )
