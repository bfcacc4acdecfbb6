"""Stored responses in an embedded SQLite database (F2): they survive a restart.

One file (`--responses-db`, default `<models dir or ~/.cache/mlxcel>/responses.sqlite3`), WAL
mode, one connection per thread. `ResponseStore` is blocking and thread-safe; the server calls
it through `AsyncResponseStore`, which runs every call on one dedicated thread so the event
loop never waits on disk and writes never contend. Without a path the database lives in
memory (tests, embedding), shared by the threads of this process.

Each row keeps the response object as returned and its conversation: every item the prompt
held except `instructions` (earlier turns, then this request's input), so a later
`previous_response_id` can rebuild the prompt from one row.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

SCHEMA_VERSION = 1
BUSY_TIMEOUT_MS = 5000
UNFINISHED_STATUSES = ("queued", "in_progress")
RESTART_ERROR = {"code": "server_error", "message": "the server stopped before this response finished"}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    previous_response_id TEXT,
    is_background INTEGER NOT NULL DEFAULT 0,
    response_json TEXT NOT NULL,
    conversation_json TEXT NOT NULL
)
"""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One row: the response object and the conversation that made its prompt."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]

    @property
    def id(self) -> str:
        return self.response["id"]

    @property
    def status(self) -> str:
        return self.response["status"]

    @property
    def history(self) -> list[dict[str, Any]]:
        """What a follow-up request chained to this one starts from: conversation, then output."""
        return self.conversation + self.response["output"]


class ResponseStore:
    """Blocking access to the responses table; safe from any thread (one connection each)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        if path is None:  # a named in-memory database that every connection of this process shares
            self._target, self._is_uri = f"file:mlxcel-responses-{uuid.uuid4().hex}?mode=memory&cache=shared", True
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._target, self._is_uri = str(path), False
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._keeper = self._connect()  # keeps an in-memory database alive; creates the schema

    def _connect(self) -> sqlite3.Connection:
        connection = sqlite3.connect(self._target, uri=self._is_uri, timeout=BUSY_TIMEOUT_MS / 1000,
                                     check_same_thread=False, isolation_level=None)
        if self.path is not None:
            connection.execute("PRAGMA journal_mode=WAL")
            # FULL: each commit is fsynced before it returns, so an acknowledged response survives
            # a killed process and a power loss alike (NORMAL in WAL mode may lose the last ones).
            connection.execute("PRAGMA synchronous=FULL")
        connection.execute(_SCHEMA)
        version = connection.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:
            connection.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        elif version != SCHEMA_VERSION:
            raise sqlite3.DatabaseError(f"{self._target}: responses schema version {version} is not "
                                        f"{SCHEMA_VERSION}; move the file away or point --responses-db elsewhere")
        with self._lock:
            self._connections.append(connection)
        return connection

    @property
    def _db(self) -> sqlite3.Connection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = self._local.connection = self._connect()
        return connection

    def save(self, stored: StoredResponse) -> None:
        """Insert or replace one response."""
        response = stored.response
        self._db.execute(
            "INSERT OR REPLACE INTO responses (id, status, created_at, updated_at, previous_response_id, "
            "is_background, response_json, conversation_json) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (response["id"], response["status"], response["created_at"], time.time(),
             response.get("previous_response_id"), int(bool(response.get("background"))),
             json.dumps(response, ensure_ascii=False), json.dumps(stored.conversation, ensure_ascii=False)))

    def load(self, response_id: str) -> StoredResponse | None:
        row = self._db.execute("SELECT response_json, conversation_json FROM responses WHERE id = ?",
                               (response_id,)).fetchone()
        return None if row is None else StoredResponse(json.loads(row[0]), json.loads(row[1]))

    def delete(self, response_id: str) -> bool:
        """Remove one response; False when there was none."""
        return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def fail_unfinished(self) -> int:
        """Mark responses left queued or in progress by an earlier process as failed; returns how many."""
        rows = self._db.execute(
            f"SELECT response_json FROM responses WHERE status IN ({', '.join('?' * len(UNFINISHED_STATUSES))})",
            UNFINISHED_STATUSES).fetchall()
        for (text,) in rows:
            response = {**json.loads(text), "status": "failed", "error": RESTART_ERROR}
            self._db.execute("UPDATE responses SET status = 'failed', updated_at = ?, response_json = ? "
                             "WHERE id = ?", (time.time(), json.dumps(response, ensure_ascii=False), response["id"]))
        return len(rows)

    def count(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        """Close every connection (the in-memory database is gone afterwards)."""
        with self._lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            connection.close()


class AsyncResponseStore:
    """`ResponseStore` for the event loop: each call runs on one dedicated database thread."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxcel-responses")

    @classmethod
    def open(cls, path: Path | None) -> AsyncResponseStore:
        """Open (or create) the database and fail what an earlier process left unfinished.

        Raises OSError naming the file when it cannot be opened (unwritable folder, not a
        database, another schema version), so startup can refuse with one line.
        """
        try:
            store = ResponseStore(path)
        except (sqlite3.Error, OSError) as exc:
            raise OSError(f"--responses-db {path}: cannot open the responses database: {exc}") from None
        async_store = cls(store)
        async_store.submit(async_store.store.fail_unfinished).result()
        return async_store

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Queue a call on the database thread; the write happens even if nobody awaits it."""
        return self._executor.submit(fn, *args)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self.submit(fn, *args))

    async def save(self, stored: StoredResponse) -> None:
        await self._call(self.store.save, stored)

    def save_nowait(self, stored: StoredResponse) -> None:
        """Queue a save from code that may not await (a cancelled task, a closing generator)."""
        self.submit(self.store.save, stored)

    async def load(self, response_id: str) -> StoredResponse | None:
        return await self._call(self.store.load, response_id)

    async def delete(self, response_id: str) -> bool:
        return await self._call(self.store.delete, response_id)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self.store.close()
