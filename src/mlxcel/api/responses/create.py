"""The Responses routes (F2, F5): create, retrieve (and its stream), delete, cancel, input_items,
input_tokens. Each handler that reads a body is two steps, so body errors (D1) come before the
availability check: `parse_*(body)` (400), then the call with the API context.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

from mlxcel.api import chat_features
from mlxcel.api.context import ApiContext
from mlxcel.api.errors import invalid_request
from mlxcel.api.generation import Generation, GenerationParams
from mlxcel.api.responses.items import new_id
from mlxcel.api.responses.objects import ResponseDraft, request_echo
from mlxcel.api.responses.prompt import plan_prompt
from mlxcel.api.responses.run import ResponseRun
from mlxcel.api.responses.schemas import InputTokensRequest, ResponseCreateRequest, parse_input_items
from mlxcel.api.responses.service import ResponsesService, not_found
from mlxcel.api.responses.stream import Event, ResponseEvents, event_frame
from mlxcel.api.responses.tools import log_hosted, parse_tools
from mlxcel.api.replies import JsonReply, Reply, StreamReply
from mlxcel.api.schema import flatten_extra_body, validate_body
from mlxcel.api.sse import with_keepalive
from mlxcel.types import Priority

PRIORITY_HEADER = "x-priority"
SEALED_REASONING = "reasoning.encrypted_content"  # include: reasoning items carry it (items.seal_reasoning)
MAX_INPUT_ITEMS_PAGE = 100


def parse_create_request(body: Any) -> ResponseCreateRequest:
    """Validate a POST /v1/responses body (extra_body fields lifted) and its items; raises ApiError(400)."""
    req = validate_body(ResponseCreateRequest, flatten_extra_body(body))
    parse_input_items(req.input)  # D1: a bad item or tool is a body error, answered before availability
    parse_tools(req.tools)
    return req


def parse_input_tokens_request(body: Any) -> InputTokensRequest:
    req = validate_body(InputTokensRequest, flatten_extra_body(body))
    parse_input_items(req.input)
    parse_tools(req.tools)
    return req


async def create_response(ctx: ApiContext, service: ResponsesService, req: ResponseCreateRequest,
                          headers: Mapping[str, str]) -> Reply:
    """Create a response: the JSON object, an SSE stream, or (background) at once while it runs.

    Everything that can be a 4xx/503 (items, chaining, media, template, queue, context) is raised
    before a stream or a background task starts.
    """
    plan = await plan_prompt(ctx, service, req)
    tools = parse_tools(req.tools)
    log_hosted(tools)
    response_id = new_id("resp")
    params = chat_features.with_chat_features(generation_params(ctx, req, headers), plan.chat)
    generation = Generation.start(ctx, [plan.prompt], params, request_id=response_id)
    draft = ResponseDraft(response_id, ctx.model_name, request_echo(req), background=req.background,
                          status="queued" if req.background else "in_progress")
    events = ResponseEvents(draft, tools=tools, seals_reasoning=SEALED_REASONING in (req.include or ()))
    run = ResponseRun(ctx, service.store, events, plan.conversation, generation, should_store=req.store,
                      plan=plan.chat, timings_per_token=req.timings_per_token)
    if req.background:
        reply = draft.to_json()
        service.launch(run)
        if req.stream:
            return _stream_reply(ctx, run.follow(), on_close=_nothing)  # leaving the stream leaves the run going
        return JsonReply(reply)
    if req.stream:
        return _stream_reply(ctx, run.drive(), on_close=run.aclose)
    await run.run_to_end()
    return JsonReply(run.draft.to_json())


async def _nothing() -> None:
    return None


def _stream_reply(ctx: ApiContext, events: AsyncIterator[Event], *, on_close: Any) -> StreamReply:
    return StreamReply(with_keepalive(_frames(events), ctx.sse_keepalive_s), on_close=on_close)


async def _frames(events: AsyncIterator[Event]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield event_frame(event)
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def generation_params(ctx: ApiContext, req: ResponseCreateRequest, headers: Mapping[str, str]) -> GenerationParams:
    """Stop strings and scheduling of a Responses request; its sampling and limits are in its
    `ChatOptions` (prompt.py), which the chat features add."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return GenerationParams(stop=stop, priority=parse_priority(headers), cache_prompt=req.cache_prompt,
                            report_progress=req.stream and req.return_progress)


def parse_priority(headers: Mapping[str, str]) -> Priority:
    """X-Priority: high | normal | low (spec L); anything else is a 400."""
    try:
        return Priority.parse(headers.get(PRIORITY_HEADER))
    except ValueError as exc:
        raise invalid_request(f"X-Priority: {exc}") from None


async def count_input_tokens(ctx: ApiContext, service: ResponsesService, req: InputTokensRequest) -> JsonReply:
    """F5: the prompt token count a create with these fields would run, without generating."""
    plan = await plan_prompt(ctx, service, req)
    return JsonReply({"object": "response.input_tokens", "input_tokens": len(plan.prompt.token_ids)})


async def retrieve_response(service: ResponsesService, response_id: str, query: Mapping[str, str], *,
                            keepalive_s: float) -> Reply:
    """GET /v1/responses/{id}; with `stream=true` a background run's events after `starting_after`."""
    if not _is_true(query.get("stream")):
        return JsonReply(await service.retrieve(response_id))
    starting_after = _int_query(query, "starting_after")
    run = service.run_of(response_id)
    if run is None or run.log is None:
        await service.retrieve(response_id)  # 404 when unknown
        raise invalid_request(f"response '{response_id}' cannot be streamed: only background responses still "
                              "held by this server process can be")
    events = run.follow(starting_after)
    return StreamReply(with_keepalive(_frames(events), keepalive_s), on_close=_nothing)


async def delete_response(service: ResponsesService, response_id: str) -> JsonReply:
    return JsonReply(await service.delete(response_id))


async def cancel_response(service: ResponsesService, response_id: str) -> JsonReply:
    return JsonReply(await service.cancel(response_id))


async def list_input_items(service: ResponsesService, response_id: str, query: Mapping[str, str]) -> JsonReply:
    """GET /v1/responses/{id}/input_items: the items its prompt held (order desc by default, as OpenAI)."""
    stored = await service.load(response_id)
    if stored is None:
        raise not_found(response_id)
    limit = _int_query(query, "limit") or 20
    if not 1 <= limit <= MAX_INPUT_ITEMS_PAGE:
        raise invalid_request(f"limit: must be between 1 and {MAX_INPUT_ITEMS_PAGE}, not {limit}")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid_request(f"order: must be asc or desc, not {order!r}")
    items = stored.conversation if order == "asc" else stored.conversation[::-1]
    items = _after(items, query.get("after"))
    page = items[:limit]
    return JsonReply({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                      "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


def _after(items: list[dict[str, Any]], after: str | None) -> list[dict[str, Any]]:
    if after is None:
        return items
    ids = [item["id"] for item in items]
    if after not in ids:
        raise invalid_request(f"after: no input item with id '{after}' in this response")
    return items[ids.index(after) + 1:]


def _is_true(value: str | None) -> bool:
    return value is not None and value.lower() in ("1", "true", "yes")


def _int_query(query: Mapping[str, str], name: str) -> int | None:
    text = query.get(name)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise invalid_request(f"{name}: must be an integer, not {text!r}") from None
