"""F9 `GET|PATCH /v1/settings` (and `/settings`): the typed schema, current values and fingerprint
from the settings table, and the appliers that make a mutable setting take effect on the next
request (default reasoning budget, loop-guard override, queue depth, decode timeout, log level).

PATCH body: `{"settings": {name: value, ...}, "replace": false}`. Merge (the default) changes the
named settings; `"replace": true` also resets every unnamed mutable setting to its startup value.
Each name is validated alone: valid ones are applied even when another is rejected, and the
reply lists both (`applied`, `rejected`); a PATCH where nothing could be applied is a 400.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from starlette.requests import Request

from mlxcel.api.errors import ApiError, invalid_request
from mlxcel.api.replies import JsonReply
from mlxcel.server.body import read_json
from mlxcel.server.state import ServerState
from mlxcel.settings import Rejection

Applier = Callable[[ServerState, Any], None]


def _features(state: ServerState, **changes: Any) -> None:
    """Swap the served model's chat features; requests already planned keep theirs."""
    if state.served is None or state.api is None:
        return  # nothing attached: `ServerState.attach` applies the live values when a model comes
    features = replace(state.served.features, **changes)
    state.served.features = features
    state.api = replace(state.api, features=features)


def _engine(state: ServerState, **changes: Any) -> None:
    if state.served is not None:
        state.served.engine.reconfigure(**changes)


def _loop_detection(state: ServerState, value: str | None) -> None:
    from mlxcel.chat.loop_guard import parse_operator_override

    _features(state, loop_operator=parse_operator_override(value))


def _verbose(state: ServerState, value: bool) -> None:
    logging.getLogger().setLevel(logging.DEBUG if value else logging.INFO)


APPLIERS: dict[str, Applier] = {
    "reasoning_budget": lambda state, value: _features(state, reasoning_budget=value),
    "loop_detection": _loop_detection,
    "max_queue_depth": lambda state, value: _engine(state, max_queue_depth=value),
    "decode_timeout": lambda state, value: _engine(state, decode_timeout_s=value),
    "default_n_predict": lambda state, value: _engine(state, n_predict=value),  # sampling defaults (-n, -s)
    "default_seed": lambda state, value: _engine(state, seed=value),
    "verbose": _verbose,
}


def apply_live_settings(state: ServerState) -> None:
    """Re-apply every mutable value that differs from startup (a model attached after a PATCH)."""
    live = state.live
    for name, value in live.current.items():
        if name in APPLIERS and value != live.startup[name]:
            APPLIERS[name](state, value)


def _body(state: ServerState) -> dict[str, Any]:
    return {"object": "settings", "fingerprint": state.live.fingerprint(), "settings": state.live.snapshot()}


async def get_settings(request: Request, state: ServerState) -> JsonReply:
    return JsonReply({**_body(state), "schema": state.live.schema()})


async def patch_settings(request: Request, state: ServerState) -> JsonReply:
    changes, is_replace = _parse_patch(await read_json(request))
    applied, rejected = state.live.patch(changes, lambda name, value: APPLIERS[name](state, value),
                                         is_replace=is_replace)
    report = {"applied": applied, "rejected": [_rejection(r) for r in rejected]}
    if rejected and not applied:
        first = rejected[0]
        raise ApiError(400, first.message if len(rejected) == 1 else f"{len(rejected)} settings rejected; "
                       f"first: {first.message}", code=first.code, extra=report)
    return JsonReply({**_body(state), **report})


def _rejection(rejection: Rejection) -> dict[str, str]:
    return {"name": rejection.name, "code": rejection.code, "message": rejection.message}


def _parse_patch(body: Any) -> tuple[dict[str, Any], bool]:
    if not isinstance(body, dict):
        raise invalid_request("the body must be a JSON object: {\"settings\": {name: value}, \"replace\": false}")
    unknown = body.keys() - {"settings", "replace"}
    if unknown:
        raise invalid_request(f"unknown field(s) {', '.join(sorted(unknown))}: the body is "
                              "{\"settings\": {name: value}, \"replace\": false}")
    changes, is_replace = body.get("settings", {}), body.get("replace", False)
    if not isinstance(changes, dict):
        raise invalid_request("'settings' must be an object of setting names to values")
    if not isinstance(is_replace, bool):
        raise invalid_request("'replace' must be true or false")
    return changes, is_replace
