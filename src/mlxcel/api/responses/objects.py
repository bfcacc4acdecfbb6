"""The Responses `response` object (F2): a live, mutable draft and its JSON.

`ResponseDraft` is what a run updates as it goes; `to_json()` is the object every route returns,
every lifecycle event carries, and the store keeps. Field names and nesting follow the
openai SDK's `Response` type, so the SDK parses each one without loss.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

from mlxcel.api.responses.schemas import ResponseCreateRequest
from mlxcel.types import Usage

TERMINAL_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled"})


def request_echo(req: ResponseCreateRequest) -> dict[str, Any]:
    """The request settings a response object repeats back (OpenAI echoes them all)."""
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "metadata": dict(req.metadata or {}),
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": (req.reasoning.model_dump() if req.reasoning else {"effort": None, "summary": None}),
        "safety_identifier": req.safety_identifier,
        "service_tier": req.service_tier or "default",
        "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": text_echo(req),
        "tool_choice": req.tool_choice or "auto",
        "tools": list(req.tools or ()),
        "top_logprobs": req.top_logprobs or 0,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation,
        "user": req.user,
    }


def text_echo(req: ResponseCreateRequest) -> dict[str, Any]:
    text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text else {}
    return {"format": text.get("format", {"type": "text"}), "verbosity": text.get("verbosity", "medium")}


def usage_json(usage: Usage, num_reasoning_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's Responses usage; no explicit cache writes exist here (no prompt_cache_breakpoint)."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": num_reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


@dataclass(slots=True)
class ResponseDraft:
    """One response as it stands; `output` holds item dicts in their final shape."""

    id: str
    model: str
    echo: dict[str, Any]
    created_at: int = field(default_factory=lambda: int(time.time()))
    background: bool = False
    status: str = "in_progress"
    output: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    completed_at: int | None = None

    @property
    def is_done(self) -> bool:
        return self.status in TERMINAL_STATUSES

    def to_json(self) -> dict[str, Any]:
        """The `response` object; a deep copy, so later changes never reach an emitted event."""
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "background": self.background,
            "completed_at": self.completed_at,
            "error": copy.deepcopy(self.error),
            "incomplete_details": copy.deepcopy(self.incomplete_details),
            "model": self.model,
            "output": copy.deepcopy(self.output),
            "usage": copy.deepcopy(self.usage),
            **copy.deepcopy(self.echo),
        }
