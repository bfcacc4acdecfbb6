"""One response being generated (F2): Generation deltas -> parsed output -> events -> store.

A `ResponseRun` is driven by whoever needs its events: the SSE stream of a `stream: true`
request, the handler of a plain request, or a background task. The deltas carry the chat
features' parsed output (reasoning, answer text, function calls; api/chat_features.py), and a
finished plain answer's reasoning is remembered for the echo (Q). It writes the store when it
starts (so `GET` finds it in progress) and when it ends, whatever the ending: completed,
incomplete (token limit), failed, or cancelled (cancel call, client gone). A background run
also keeps its event log so `GET ?stream=true` can replay and follow it.

llama-server's telemetry (llama_server/results.stream_telemetry): with `return_progress` each
prefill chunk is one more response.in_progress event carrying `prompt_progress`; with
`timings_per_token` the last event of each step carries `timings`; the terminal event of a
finished response carries the final `timings` either way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from mlxcel.api import chat_features
from mlxcel.api.context import ApiContext
from mlxcel.api.generation import ChoiceDelta, Generation, failure_error
from mlxcel.api.llama_server.results import reply_timings, stream_telemetry
from mlxcel.api.responses.items import Item
from mlxcel.api.responses.objects import ResponseDraft, usage_json
from mlxcel.api.responses.store import AsyncResponseStore, StoredResponse
from mlxcel.api.responses.stream import Event, ResponseEvents
from mlxcel.chat.plan import ChatPlan
from mlxcel.chat.events import ContentDelta

CANCEL_WAIT_S = 30.0  # how long a cancel call waits for the run to record its end
ABORTED_ERROR = {"code": "server_error", "message": "generation was aborted before it finished "
                 "(the server is shutting down)"}
# finish reason -> (status, incomplete_details.reason)
FINISH_STATUS = {"stop": ("completed", None), "length": ("incomplete", "max_output_tokens"),
                 "loop": ("incomplete", "loop_detected")}


class ResponseRun:
    """One response's generation, events and storage."""

    def __init__(self, ctx: ApiContext, store: AsyncResponseStore, events: ResponseEvents, conversation: list[Item],
                 generation: Generation, *, should_store: bool, plan: ChatPlan | None = None,
                 timings_per_token: bool = False) -> None:
        self.ctx = ctx
        self.store = store
        self.events = events
        draft = events.draft
        self.conversation = conversation
        self.generation = generation
        self.should_store = should_store
        self.plan = plan  # for the reasoning echo
        self.timings_per_token = timings_per_token
        self.log: list[Event] | None = [] if draft.background else None
        self.is_cancel_requested = False
        self.is_finished = False
        self.task: asyncio.Task[None] | None = None
        self._tick = asyncio.Event()

    @property
    def draft(self) -> ResponseDraft:
        return self.events.draft

    @property
    def id(self) -> str:
        return self.draft.id

    def stored(self) -> StoredResponse:
        return StoredResponse(self.draft.to_json(), self.conversation)

    async def drive(self) -> AsyncIterator[Event]:
        """Every event of the response, in order; leaving early records the response as cancelled."""
        try:
            for event in self._record(self.events.start()):
                yield event
            await self._save()
            finish_reason = None
            try:
                async for delta in self.generation.stream():
                    for event in self._record(self._delta_events(delta)):
                        yield event
                    finish_reason = delta.finish_reason or finish_reason
                final = self._final(finish_reason)
                if self.plan is not None:
                    chat_features.remember_replies(self.plan, self.generation.results())
            except Exception as exc:  # noqa: BLE001 - a failure after the response began (timeout, engine, a bug)
                error = failure_error(self.generation.ctx, exc, self.id)
                final = self._finish("failed", error={"code": "server_error", "message": error.message})
            # Stored before the client can see the end: a response it saw finish survives a crash.
            await asyncio.shield(self._save())  # written even if the listener leaves now
            for event in self._record(final):
                yield event
        finally:
            if not self.draft.is_done:  # cancelled task or closed stream: record it without awaiting
                list(self._record(self._finish("cancelled")))
                self._save_nowait()
            self.is_finished = True
            self._wake()

    def _delta_events(self, delta: ChoiceDelta) -> list[Event]:
        """A step's events: a prefill chunk's response.in_progress, else its output; telemetry on the last."""
        events = [self.events.in_progress()] if delta.progress is not None else self._output(delta)
        if events:
            events[-1].update(stream_telemetry(self.generation, delta, is_timed=self.timings_per_token))
        return events

    def _output(self, delta: ChoiceDelta) -> list[Event]:
        parsed = delta.events if delta.events or not delta.text else (ContentDelta(delta.text),)
        events = []
        logprobs = delta.logprobs
        for piece in parsed:
            events += self.events.feed(piece, logprobs if isinstance(piece, ContentDelta) else ())
            if isinstance(piece, ContentDelta):
                logprobs = ()  # a step's logprobs go with its first text
        return events

    def _final(self, finish_reason: str | None) -> list[Event]:
        if finish_reason in FINISH_STATUS:
            status, reason = FINISH_STATUS[finish_reason]
            return self._finish(status, incomplete_reason=reason)
        if self.is_cancel_requested:
            return self._finish("cancelled")
        return self._finish("failed", error=ABORTED_ERROR)

    def _finish(self, status: str, *, incomplete_reason: str | None = None,
                error: dict[str, Any] | None = None) -> list[Event]:
        usage = self.generation.usage()
        events = self.events.finish(status, usage=usage_json(usage), incomplete_reason=incomplete_reason,
                                    error=error, completed_at=int(time.time()))
        if status in ("completed", "incomplete"):
            self.ctx.telemetry.record_completed_request(usage)  # K2: as chat counts a finished request
            events[-1]["timings"] = reply_timings(self.generation.results())  # llama-server's, on the terminal event
        return events

    def _record(self, events: Iterable[Event]) -> Iterable[Event]:
        for event in events:
            if self.log is not None:
                self.log.append(event)
            self._wake()
            yield event

    def _wake(self) -> None:
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    async def _save(self) -> None:
        if self.should_store:
            await self.store.save(self.stored())

    def _save_nowait(self) -> None:
        if self.should_store:
            self.store.save_nowait(self.stored())

    async def run_to_end(self) -> None:
        """Drive the run without a listener (a plain request, a background task)."""
        async for _ in self.drive():
            pass

    async def follow(self, starting_after: int | None = None) -> AsyncIterator[Event]:
        """A background run's events after `starting_after` (a sequence number), then live ones."""
        assert self.log is not None, "only background runs keep their events"
        index = 0 if starting_after is None else starting_after + 1
        while True:
            tick = self._tick
            while index < len(self.log):
                yield self.log[index]
                index += 1
            if self.is_finished:
                return
            await tick.wait()

    async def cancel(self) -> None:
        """Abort the generation and wait (bounded) until the run has recorded itself cancelled."""
        self.is_cancel_requested = True
        await self.generation.aclose()
        if self.task is not None and not self.task.done():
            await asyncio.wait({self.task}, timeout=CANCEL_WAIT_S)

    async def aclose(self) -> None:
        """Free the engine slot if the run is still going (its stream's listener left)."""
        if not self.is_finished:
            await self.generation.aclose()
