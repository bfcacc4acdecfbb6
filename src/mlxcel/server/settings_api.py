"""F9 `GET|PATCH /v1/settings` (and `/settings`): the typed schema, current values and fingerprint
from the settings table; a PATCHed value takes effect on the next request through the state's
appliers (`ServerState.apply_setting`: default reasoning budget, loop-guard override, queue
depth, decode timeout, log level).

PATCH body: `{"settings": {name: value, ...}, "replace": false}`. Merge (the default) changes the
named settings; `"replace": true` also resets every unnamed mutable setting to its startup value.
Each name is validated alone: valid ones are applied even when another is rejected, and the
reply lists both (`applied`, `rejected`); a PATCH where nothing could be applied is a 400.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from mlxcel.api.errors import ApiError, invalid_request
from mlxcel.api.replies import JsonReply
from mlxcel.server.body import read_json
from mlxcel.server.state import ServerState
from mlxcel.settings import Rejection


def _body(state: ServerState) -> dict[str, Any]:
    """The settings, and the sampling defaults in effect: each value and where it came from (server,
    checkpoint or llama-server, issue 46); null while no chat model is loaded."""
    sampling = state.api.sampling.sources() if state.api is not None else None
    return {"object": "settings", "fingerprint": state.live.fingerprint(), "settings": state.live.snapshot(),
            "sampling_defaults": sampling}


async def get_settings(request: Request, state: ServerState) -> JsonReply:
    return JsonReply({**_body(state), "schema": state.live.schema()})


async def patch_settings(request: Request, state: ServerState) -> JsonReply:
    changes, is_replace = _parse_patch(await read_json(request))
    applied, rejected = state.live.patch(changes, state.apply_setting, is_replace=is_replace)
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
