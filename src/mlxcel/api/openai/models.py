"""GET /v1/models and /v1/models/{id} (F1): the one served model."""

from __future__ import annotations

from typing import Any

from mlxcel.api.context import ApiContext
from mlxcel.api.errors import ApiError
from mlxcel.api.replies import JsonReply


def model_card(ctx: ApiContext) -> dict[str, Any]:
    return {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "mlxcel",
            "max_model_len": ctx.context_size}


def list_models(ctx: ApiContext) -> JsonReply:
    return JsonReply({"object": "list", "data": [model_card(ctx)]})


def retrieve_model(ctx: ApiContext, model_id: str) -> JsonReply:
    if model_id != ctx.model_name:
        raise ApiError(404, f"the model {model_id!r} does not exist; this server serves {ctx.model_name!r}",
                       "not_found_error", code=404)
    return JsonReply(model_card(ctx))
