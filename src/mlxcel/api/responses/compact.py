"""POST /v1/responses/compact (F2): older turns summarised by the model into one compaction item.

The conversation (previous_response_id's history + input) is split at its last user message:
everything before it becomes a transcript the served model summarises; the last turn is kept
verbatim. The reply is a `response.compaction` whose output is

    [{"type": "compaction", "encrypted_content": <summary>}, ...the last turn's items]

and is meant to be sent back as the next request's `input`. The "encrypted" content is the
plain summary text (this server has nothing to hide it from): a compaction item in a later
request joins the leading system message (api/responses/items.py). A conversation of one turn
is summarised whole.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from mlxcel.api.context import ApiContext
from mlxcel.api.errors import invalid_request
from mlxcel.api.generation import Generation, GenerationParams, Prompt
from mlxcel.api.media import validate_media
from mlxcel.api.responses.items import Item, conversation_turns, media_refs, new_id, parts_text, stored_items
from mlxcel.api.responses.objects import usage_json
from mlxcel.api.responses.schemas import CompactRequest, parse_input_items
from mlxcel.api.responses.service import ResponsesService
from mlxcel.api.replies import JsonReply
from mlxcel.api.schema import flatten_extra_body, validate_body
from mlxcel.text.chat_template import TemplateError
from mlxcel.types import SamplingParams

DEFAULT_SUMMARY_TOKENS = 256
SUMMARY_INSTRUCTIONS = (
    "You condense conversations. Write a short summary of the conversation below that keeps every fact, "
    "decision, name, number and open question needed to continue it. Write only the summary.")


def parse_compact_request(body: Any) -> CompactRequest:
    """Validate a POST /v1/responses/compact body and its items; raises ApiError(400)."""
    req = validate_body(CompactRequest, flatten_extra_body(body))
    parse_input_items(req.input)  # D1: before availability
    return req


async def compact_response(ctx: ApiContext, service: ResponsesService, req: CompactRequest) -> JsonReply:
    """Summarise all but the last turn with the served model (greedy) into one compaction item."""
    items = parse_input_items(req.input)
    await validate_media(ctx, media_refs(items))
    conversation = await service.history(req.previous_response_id) + stored_items(items)
    if not conversation:
        raise invalid_request("there is nothing to compact: the previous response holds no items")
    older, kept = conversation_turns(conversation)
    if not older:
        older, kept = conversation, []
    prompt = summary_prompt(ctx, older)
    sampling = SamplingParams(temperature=0.0, max_tokens=req.max_output_tokens or DEFAULT_SUMMARY_TOKENS)
    compaction_id = new_id("resp")
    generation = Generation.start(ctx, [prompt], GenerationParams(sampling), request_id=compaction_id)
    summary = (await generation.collect())[0].text.strip()
    usage = generation.usage()
    ctx.telemetry.record_completed_request(usage)
    item = {"id": new_id("cmp"), "type": "compaction", "encrypted_content": summary, "created_by": ctx.model_name}
    return JsonReply({"id": compaction_id, "object": "response.compaction", "created_at": int(time.time()),
                      "output": [item, *kept], "usage": usage_json(usage)})


def summary_prompt(ctx: ApiContext, older: Sequence[Item]) -> Prompt:
    """The summarisation request: fixed instructions, then the older turns as one transcript."""
    if ctx.chat_template is None:
        raise invalid_request("this model has no chat template: start the server with --chat-template "
                              "or --chat-template-file")
    messages = [{"role": "system", "content": SUMMARY_INSTRUCTIONS},
                {"role": "user", "content": transcript(older)}]
    try:
        text = ctx.chat_template.render(messages, add_generation_prompt=True)
    except TemplateError as exc:
        raise invalid_request(f"the chat template could not render the summary request: {exc}") from None
    return Prompt(tuple(ctx.tokenizer.encode(text, add_special_tokens=False)), text)


def transcript(items: Sequence[Item]) -> str:
    """One line (or paragraph) per item: who said or did what; earlier summaries come first."""
    return "\n\n".join(line for index, item in enumerate(items) if (line := _line(index, item)))


def _line(index: int, item: Item) -> str:
    kind = item["type"]
    if kind == "message":
        return f"{item['role'].capitalize()}: {parts_text(f'input.{index}', item['content'])}"
    if kind == "function_call":
        return f"Assistant called {item['name']}({item['arguments']})"
    if kind == "function_call_output":
        output = item["output"]
        text = output if isinstance(output, str) else parts_text(f"input.{index}.output", output)
        return f"Tool result for {item['call_id']}: {text}"
    if kind == "compaction":
        return f"Summary of what came before: {item['encrypted_content']}"
    return ""  # reasoning: the model's private notes are not what the summary must keep
