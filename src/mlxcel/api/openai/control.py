"""POST /v1/chat/completions/control (F5): live control of a running chat completion, as in
llama-server.

Body `{"id": "chatcmpl-...", "action": "reasoning_end", "model": ...}` (`model` optional). The
completion must have been started with `"reasoning_control": true`; `reasoning_end` then forces
the reasoning-end marker (`</think>`) as its next tokens, on every choice, and the answer follows.

Replies, following llama-server: 200 `{"id", "action", "success", "message"}`, with
`success: false` for an id that is not running (never was, or already finished: llama-server
answers 200 "no active completion for this id" there, not 404) and for a completion that has
already left its reasoning. 400 for a bad body (D1), an unknown action, a completion that did
not opt in, or a model without reasoning markers.
"""

from __future__ import annotations

from typing import Any

from mlxcel.api.chat_features import features_of
from mlxcel.api.context import ApiContext
from mlxcel.api.control import ControlOutcome
from mlxcel.api.errors import invalid_request
from mlxcel.api.openai.schemas import ControlRequest
from mlxcel.api.replies import JsonReply
from mlxcel.api.schema import validate_body

REASONING_END = "reasoning_end"
ACTIONS = (REASONING_END,)

_MESSAGES = {
    ControlOutcome.UNKNOWN: "no active completion for this id",
    ControlOutcome.ENDING: "reasoning ends at the next token",
    ControlOutcome.ALREADY_ENDED: "the completion has already finished reasoning",
}


def parse_control_request(body: Any) -> ControlRequest:
    """Validate a control body; an unknown action is a 400 here, before availability (D1)."""
    req = validate_body(ControlRequest, body)
    if req.action not in ACTIONS:
        raise invalid_request(f"action: unknown control action {req.action!r}; supported: {', '.join(ACTIONS)}")
    return req


def control_chat_completion(ctx: ApiContext, req: ControlRequest) -> JsonReply:
    """Apply `req.action` to the running completion `req.id` (see the module docstring)."""
    if features_of(ctx).think is None:
        raise invalid_request(f"{ctx.model_name} has no reasoning markers: there is no reasoning to end")
    outcome = ctx.controls.end_reasoning(req.id)
    if outcome is ControlOutcome.NOT_OPTED_IN:
        raise invalid_request(f"completion {req.id} was not started with \"reasoning_control\": true; "
                              "only a completion that opted in can be controlled")
    return JsonReply({"id": req.id, "action": req.action, "success": outcome is ControlOutcome.ENDING,
                      "message": _MESSAGES[outcome]})
