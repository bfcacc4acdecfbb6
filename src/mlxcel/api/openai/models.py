"""GET /v1/models and /v1/models/{id} (F1): the served chat model and the side providers (spec I).

Each card carries `capabilities`: "completion" for the chat model (and "block_diffusion" for a
block-diffusion one, spec U; and "multimodal", as llama-server says it, for one that takes images: issue
43), "embedding" or "rerank"
for a provider. An embedding-only or rerank-only process lists only its provider.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlxcel.api.context import ApiContext
from mlxcel.api.errors import ApiError
from mlxcel.api.modes import ModelEntry
from mlxcel.api.replies import JsonReply


def model_card(ctx: ApiContext) -> dict[str, Any]:
    return {"id": ctx.model_name, "aliases": list(ctx.aliases), "tags": list(ctx.tags), "object": "model",
            "created": ctx.created, "owned_by": "mlxcel", "max_model_len": ctx.context_size,
            "capabilities": ["completion", *(["block_diffusion"] if _is_block_diffusion(ctx) else []),
                             *(["multimodal"] if ctx.image_marker is not None else [])],
            **({"weights": dict(ctx.weights)} if ctx.weights else {})}  # issue 42: format, bits, bytes resident


def _is_block_diffusion(ctx: ApiContext) -> bool:
    """Spec U: the model is served by the serial block-diffusion worker, not the batch engine."""
    return ctx.engine.stats().diffusion is not None


def entry_card(entry: ModelEntry) -> dict[str, Any]:
    return {"id": entry.name, "object": "model", "created": entry.created, "owned_by": "mlxcel",
            "max_model_len": entry.max_model_len, "capabilities": list(entry.capabilities)}


def _cards(ctx: ApiContext | None, providers: Sequence[ModelEntry]) -> list[dict[str, Any]]:
    chat = [model_card(ctx)] if ctx is not None else []
    return chat + [entry_card(entry) for entry in providers]


def list_models(ctx: ApiContext | None, providers: Sequence[ModelEntry] = ()) -> JsonReply:
    """`ctx` is None in a process that serves no chat model."""
    return JsonReply({"object": "list", "data": _cards(ctx, providers)})


def retrieve_model(ctx: ApiContext | None, model_id: str, providers: Sequence[ModelEntry] = ()) -> JsonReply:
    cards = _cards(ctx, providers)
    for card in cards:
        if card["id"] == model_id or model_id in card.get("aliases", ()):
            return JsonReply(card)
    served = ", ".join(repr(card["id"]) for card in cards)
    raise ApiError(404, f"the model {model_id!r} does not exist; this server serves {served}",
                   "not_found_error", code=404)
