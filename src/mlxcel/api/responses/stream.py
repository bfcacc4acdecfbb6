"""The Responses event sequence (F2): output deltas in, the documented events out, in order.

    response.created, response.in_progress,
    per output item: response.output_item.added, response.content_part.added,
        response.output_text.delta ... response.output_text.done        (message)
        response.reasoning_text.delta ... response.reasoning_text.done  (reasoning)
        response.function_call_arguments.delta ... .done                 (function_call)
        response.custom_tool_call_input.done                             (custom_tool_call)
    response.content_part.done, response.output_item.done,
    response.completed | response.incomplete | response.failed

Every event has a `sequence_number`; the draft response is kept in step, so a `GET` while
streaming and the final lifecycle event agree with the deltas. The input is the text layer's
protocol-neutral `OutputEvent`s (chat/events.py), so reasoning and tool calls parsed from the
model's text map to their own output items without touching this sequence.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from mlxcel.api.generation import LogprobText
from mlxcel.api.responses.items import IdFactory, new_id, seal_reasoning
from mlxcel.api.responses.objects import ResponseDraft
from mlxcel.api.responses.tools import ToolSet, custom_input
from mlxcel.api.sse import sse_frame
from mlxcel.chat.events import (
    ContentDelta, OutputEvent, ReasoningDelta, ToolCallArguments, ToolCallEnd, ToolCallStart,
)  # fmt: skip

Event = dict[str, Any]
# The terminal event of each final status; a cancelled response has none (OpenAI defines none).
TERMINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
                   "failed": "response.failed"}


class ResponseEvents:
    """Builds one response's events; `draft` is updated as they are made."""

    def __init__(self, draft: ResponseDraft, make_id: IdFactory = new_id, *, tools: ToolSet | None = None,
                 seals_reasoning: bool = False) -> None:
        self.draft = draft
        self.make_id = make_id
        self.tools = tools or ToolSet()  # a call's template name -> the client's tool (custom, namespace)
        self.seals_reasoning = seals_reasoning  # include: reasoning.encrypted_content
        self.sequence_number = 0
        self._open: dict[str, Any] | None = None  # the output item receiving deltas
        self._calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its function_call item

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def _lifecycle(self, kind: str) -> Event:
        return self._event(kind, response=self.draft.to_json())

    def start(self) -> list[Event]:
        """response.created (queued for a background response) then response.in_progress."""
        events = [self._lifecycle("response.created")]
        self.draft.status = "in_progress"
        return events + [self._lifecycle("response.in_progress")]

    def in_progress(self) -> Event:
        """Another response.in_progress: llama-server's return_progress sends one per prefill chunk."""
        return self._lifecycle("response.in_progress")

    def feed(self, event: OutputEvent, logprobs: Sequence[LogprobText] = ()) -> list[Event]:
        """The events for one parsed piece of output."""
        if isinstance(event, ContentDelta):
            return self._text_delta("message", "response.output_text.delta", event.text, logprobs)
        if isinstance(event, ReasoningDelta):
            return self._text_delta("reasoning", "response.reasoning_text.delta", event.text, ())
        if isinstance(event, ToolCallStart):
            return self._call_start(event)
        if isinstance(event, ToolCallArguments):
            return self._call_arguments(event)
        return self._call_end(event)

    def finish(self, status: str, *, usage: dict[str, Any] | None, incomplete_reason: str | None = None,
               error: dict[str, Any] | None = None, completed_at: int | None = None) -> list[Event]:
        """Close the open item and end with the lifecycle event of `status`."""
        events = []
        if not self.draft.output and status in ("completed", "incomplete"):
            events = self._add_text_item("message")  # a reply with no text still has its (empty) message
        events += self._close(item_status="completed" if status == "completed" else "incomplete")
        events += self._close_unfinished_calls()
        draft = self.draft
        draft.status, draft.usage, draft.error = status, usage, error
        draft.incomplete_details = {"reason": incomplete_reason} if incomplete_reason else None
        draft.completed_at = completed_at if status == "completed" else None
        terminal = TERMINAL_EVENTS.get(status)
        return events + ([self._lifecycle(terminal)] if terminal else [])

    # ---- text items: message and reasoning ----

    def _text_delta(self, kind: str, delta_type: str, text: str, logprobs: Sequence[LogprobText]) -> list[Event]:
        events = [] if self._is_open(kind) else self._close() + self._add_text_item(kind)
        item = self._open
        assert item is not None
        part = item["content"][0]
        part["text"] += text
        fields = self._item_fields(item)
        if kind == "message":
            entries = [logprob_json(lp) for lp in logprobs]
            part["logprobs"].extend(entries)
            short = [delta_logprob(e) for e in entries]
            return events + [self._event(delta_type, **fields, delta=text, logprobs=short)]
        return events + [self._event(delta_type, **fields, delta=text)]

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open["type"] == kind

    def _add_text_item(self, kind: str) -> list[Event]:
        if kind == "message":
            item = {"id": self.make_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": self.make_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                    "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.draft.output.append(item)
        self._open = item
        added = self._event("response.output_item.added", output_index=len(self.draft.output) - 1,
                            item=copy.deepcopy(item))
        item["content"].append(part)
        return [added, self._event("response.content_part.added", **self._item_fields(item), part=copy.deepcopy(part))]

    def _item_fields(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.draft.output.index(item), "content_index": 0}

    def _close(self, item_status: str = "completed") -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        fields = self._item_fields(item)
        part = item["content"][0]
        if item["type"] == "message":
            done = self._event("response.output_text.done", **fields, text=part["text"],
                               logprobs=[delta_logprob(e) for e in part["logprobs"]])
        else:
            done = self._event("response.reasoning_text.done", **fields, text=part["text"])
            if self.seals_reasoning:
                item["encrypted_content"] = seal_reasoning(part["text"])
        item["status"] = item_status
        return [done, self._event("response.content_part.done", **fields, part=copy.deepcopy(part)),
                self._event("response.output_item.done", output_index=fields["output_index"],
                            item=copy.deepcopy(item))]

    # ---- function calls ----

    def _call_start(self, event: ToolCallStart) -> list[Event]:
        events = self._close()
        target = self.tools.target(event.name)
        if target.kind == "custom":
            item = {"id": self.make_id("ctc"), "type": "custom_tool_call", "status": "in_progress",
                    "call_id": event.id, "name": target.name, "input": ""}
        else:
            item = {"id": self.make_id("fc"), "type": "function_call", "status": "in_progress", "call_id": event.id,
                    "name": target.name, "arguments": ""}
        if target.namespace is not None:
            item["namespace"] = target.namespace
        self.draft.output.append(item)
        self._calls[event.index] = item
        return events + [self._event("response.output_item.added", output_index=len(self.draft.output) - 1,
                                     item=copy.deepcopy(item))]

    def _call_arguments(self, event: ToolCallArguments) -> list[Event]:
        item = self._calls[event.index]
        if item["type"] == "custom_tool_call":
            return []  # its free-form input is read from the whole arguments at the end
        item["arguments"] += event.text
        return [self._event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=self.draft.output.index(item), delta=event.text)]

    def _call_end(self, event: ToolCallEnd) -> list[Event]:
        item = self._calls[event.index]
        if not event.is_complete:
            return []  # cut by the token limit: `finish` ends it as an incomplete item, its arguments as written
        item["status"] = "completed"
        index = self.draft.output.index(item)
        if item["type"] == "custom_tool_call":
            item["input"] = custom_input(event.arguments)
            done = self._event("response.custom_tool_call_input.done", item_id=item["id"], output_index=index,
                               input=item["input"])
        else:
            item["arguments"] = event.arguments
            done = self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               arguments=event.arguments)
        return [done, self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]


    def _close_unfinished_calls(self) -> list[Event]:
        """Calls cut off by the token limit or an error end as incomplete items."""
        events = []
        for item in self._calls.values():
            if item["status"] == "in_progress":
                item["status"] = "incomplete"
                events.append(self._event("response.output_item.done", output_index=self.draft.output.index(item),
                                          item=copy.deepcopy(item)))
        return events


def logprob_json(entry: LogprobText) -> dict[str, Any]:
    """An output_text logprob: token, bytes, logprob and its top alternatives."""
    def one(e: LogprobText) -> dict[str, Any]:
        return {"token": e.token, "bytes": list(e.bytes), "logprob": e.logprob}
    return {**one(entry), "top_logprobs": [one(t) for t in entry.top]}


def delta_logprob(entry: dict[str, Any]) -> dict[str, Any]:
    """The shorter logprob shape of text delta/done events (no bytes)."""
    return {"token": entry["token"], "logprob": entry["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in entry["top_logprobs"]]}


def event_frame(event: Event) -> str:
    """One SSE frame, named by the event's type as OpenAI sends them (no [DONE] on this route)."""
    return sse_frame(event, event=event["type"])
