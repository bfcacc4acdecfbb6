"""GET / POST /lora-adapters (F8), as llama-server answers them.

GET lists `[{id, path, scale}]`; POST takes `[{id, scale}]` and sets the global scales that
requests without their own `lora` field use: adapters not named get 0, an unknown id is a
400 naming it and changes nothing.
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError

from mlxcel.api.context import ApiContext
from mlxcel.api.errors import invalid_request
from mlxcel.api.replies import JsonReply
from mlxcel.api.schema import LoraEntry, validation_message

_ENTRIES = TypeAdapter(list[LoraEntry])


def parse_lora_request(body: Any) -> tuple[tuple[int, float], ...]:
    """A POST /lora-adapters body as (id, scale) pairs; 400 on anything but a list of {id, scale}."""
    if not isinstance(body, list):
        raise invalid_request(f"the request body must be a JSON array of {{id, scale}}, not {type(body).__name__}")
    try:
        entries = _ENTRIES.validate_python(body, strict=True)
    except ValidationError as exc:
        raise invalid_request(validation_message(exc)) from None
    return tuple((e.id, e.scale) for e in entries)


def list_adapters(ctx: ApiContext) -> JsonReply:
    return JsonReply(ctx.lora.list())


def set_adapters(ctx: ApiContext, entries: tuple[tuple[int, float], ...]) -> JsonReply:
    try:
        ctx.lora.set_global(entries)
    except ValueError as exc:
        raise invalid_request(str(exc)) from None
    return JsonReply({"success": True})
