"""The Responses API's server-wide state (F2): the store, and the runs in flight in this process.

Background runs are owned here (a task each, kept referenced until done); a few finished ones
stay in memory so `GET ?stream=true` can still replay their events. Lookups prefer a live run
(its draft is newer than the stored row) and fall back to the database.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from pathlib import Path
from typing import Any

from mlxcel.api.errors import ApiError, invalid_request
from mlxcel.api.responses.run import ResponseRun
from mlxcel.api.responses.store import AsyncResponseStore, StoredResponse

MAX_RECENT_RUNS = 64  # finished background runs whose event logs are kept for replay


def not_found(response_id: str) -> ApiError:
    """OpenAI's reply for an unknown (or deleted, or never stored) response id."""
    return ApiError(404, f"Response with id '{response_id}' not found.", "invalid_request_error",
                    extra={"param": "response_id"})


def previous_not_found(response_id: str) -> ApiError:
    """OpenAI's 400 for a `previous_response_id` it does not have."""
    return ApiError(400, f"Previous response with id '{response_id}' not found.", "invalid_request_error",
                    code="previous_response_not_found", extra={"param": "previous_response_id"})


class ResponsesService:
    """Stored responses plus this process's live background runs."""

    def __init__(self, store: AsyncResponseStore) -> None:
        self.store = store
        self._live: dict[str, ResponseRun] = {}
        self._recent: OrderedDict[str, ResponseRun] = OrderedDict()

    @classmethod
    def open(cls, path: Path | None) -> ResponsesService:
        """Open the database at `path` (None: in memory, for tests and embedding)."""
        return cls(AsyncResponseStore.open(path))

    def launch(self, run: ResponseRun) -> None:
        """Run a background response to its end on a task of the running loop."""
        self._live[run.id] = run
        run.task = asyncio.get_running_loop().create_task(self._background(run), name=f"response {run.id}")

    async def _background(self, run: ResponseRun) -> None:
        try:
            await run.run_to_end()
        finally:
            self._live.pop(run.id, None)
            self._recent[run.id] = run
            while len(self._recent) > MAX_RECENT_RUNS:
                self._recent.popitem(last=False)

    def run_of(self, response_id: str) -> ResponseRun | None:
        """The background run of `response_id` this process still has in memory, if any."""
        return self._live.get(response_id) or self._recent.get(response_id)

    async def load(self, response_id: str) -> StoredResponse | None:
        live = self._live.get(response_id)
        if live is not None:
            return live.stored()
        return await self.store.load(response_id)

    async def history(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        """The items a chained request starts from: the previous conversation and its output."""
        if previous_response_id is None:
            return []
        previous = await self.load(previous_response_id)
        if previous is None:
            raise previous_not_found(previous_response_id)
        return previous.history

    async def retrieve(self, response_id: str) -> dict[str, Any]:
        stored = await self.load(response_id)
        if stored is None:
            raise not_found(response_id)
        return stored.response

    async def delete(self, response_id: str) -> dict[str, Any]:
        """Delete a stored response (cancelling it first if it is still running)."""
        live = self._live.get(response_id)
        if live is not None:
            await live.cancel()
        self._recent.pop(response_id, None)
        if not await self.store.delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """Cancel a background response in flight; one already cancelled is returned as it is."""
        stored = await self.load(response_id)
        if stored is None:
            raise not_found(response_id)
        if not stored.response.get("background"):
            raise invalid_request("Only responses created with background set to true can be cancelled.")
        live = self._live.get(response_id)
        if live is not None:
            await live.cancel()
            return live.draft.to_json()
        if stored.status in ("queued", "in_progress"):  # no run in this process: mark it
            response = {**stored.response, "status": "cancelled"}
            await self.store.save(StoredResponse(response, stored.conversation))
            return response
        if stored.status != "cancelled":
            raise invalid_request(f"Cannot cancel a response with status '{stored.status}'.")
        return stored.response

    def close(self) -> None:
        self.store.close()
