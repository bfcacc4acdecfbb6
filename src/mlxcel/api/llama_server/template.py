"""llama-server native `POST /apply-template` (F4): the exact prompt /v1/chat/completions would use.

The messages take the chat route's shape (api/openai/messages.py) and go through the same renderer (api/chat_prompt.py),
so sending the returned `prompt` to `/completion` generates what chat would: server and request
template kwargs (S) and the reasoning echo (Q) are applied as chat applies them.
"""

from __future__ import annotations

from typing import Any

from mlxcel.api import chat_features, chat_prompt
from mlxcel.api.chat_options import build_chat_options
from mlxcel.api.context import ApiContext
from mlxcel.api.llama_server.schemas import ApplyTemplateRequest
from mlxcel.api.openai.messages import template_messages
from mlxcel.api.replies import JsonReply
from mlxcel.api.schema import flatten_extra_body, validate_body


def parse_apply_template_request(body: Any) -> ApplyTemplateRequest:
    """Validate like a chat body (extra_body fields lifted to the root); raises ApiError(400)."""
    return validate_body(ApplyTemplateRequest, flatten_extra_body(body))


def apply_template(ctx: ApiContext, req: ApplyTemplateRequest) -> JsonReply:
    """`{"prompt": text}` rendered by the served model's chat template; a template failure is a 400."""
    return JsonReply({"prompt": render_template(ctx, req)})


def render_template(ctx: ApiContext, req: ApplyTemplateRequest) -> str:
    """The prompt text chat would generate from (also what vLLM's `/tokenize` with `messages` counts)."""
    messages = template_messages([m.model_dump(exclude_none=True) for m in req.messages])
    options = build_chat_options(req, tools=req.tools, output=[("response_format", req.response_format)])
    plan = chat_features.plan_chat(ctx, options, messages)
    text = chat_prompt.render_chat_text(
        ctx, plan.messages, tools=plan.tools, add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message, template_kwargs=plan.template_kwargs)
    return text
