"""The Responses store (F2): a real SQLite file in WAL mode that outlives its process's objects."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from mlxcel.api.responses.service import ResponsesService
from mlxcel.api.responses.store import RESTART_ERROR, AsyncResponseStore, ResponseStore, StoredResponse


def response(response_id: str, status: str = "completed", **fields: Any) -> dict[str, Any]:
    output = [{"id": "msg_o", "type": "message", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "Hello", "annotations": []}]}]
    return {"id": response_id, "object": "response", "created_at": 100, "status": status, "output": output,
            "previous_response_id": None, "background": False, **fields}


CONVERSATION = [{"id": "msg_i", "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": "Hi é"}]}]


def test_f2_save_load_delete_across_instances(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "responses.sqlite3"
    first = ResponseStore(path)
    first.save(StoredResponse(response("resp_a"), CONVERSATION))
    first.close()
    second = ResponseStore(path)  # a new process would open the file the same way
    loaded = second.load("resp_a")
    assert loaded is not None and loaded.response == response("resp_a") and loaded.conversation == CONVERSATION
    assert loaded.history == CONVERSATION + response("resp_a")["output"]
    assert second.delete("resp_a") is True and second.delete("resp_a") is False and second.load("resp_a") is None
    second.close()


def test_f2_file_is_wal_and_versioned(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    ResponseStore(path).close()
    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert raw.execute("PRAGMA user_version").fetchone()[0] == 1
    raw.execute("PRAGMA user_version=99")
    raw.close()
    with pytest.raises(sqlite3.DatabaseError, match="schema version 99"):
        ResponseStore(path)
    with pytest.raises(OSError, match=r"--responses-db .*schema version 99"):
        AsyncResponseStore.open(path)


def test_f2_a_file_that_is_not_a_database_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    path.write_bytes(b"not a database at all, just some bytes" * 10)
    with pytest.raises(OSError, match="cannot open the responses database"):
        AsyncResponseStore.open(path)


def test_f2_save_replaces_the_row(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3")
    store.save(StoredResponse(response("resp_a", "in_progress"), CONVERSATION))
    store.save(StoredResponse(response("resp_a", "completed"), CONVERSATION))
    assert store.count() == 1 and store.load("resp_a").status == "completed"  # type: ignore[union-attr]


def test_f2_unfinished_rows_of_a_dead_process_become_failed(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    store = ResponseStore(path)
    store.save(StoredResponse(response("resp_q", "queued", background=True), []))
    store.save(StoredResponse(response("resp_d"), []))
    store.close()
    service = ResponsesService.open(path)  # what a restarted server does
    failed = asyncio.run(service.retrieve("resp_q"))
    assert failed["status"] == "failed" and failed["error"] == RESTART_ERROR
    assert asyncio.run(service.retrieve("resp_d"))["status"] == "completed"
    service.close()


def test_f2_memory_store_is_shared_by_threads_and_private_to_its_store() -> None:
    store, other = ResponseStore(None), ResponseStore(None)
    worker = threading.Thread(target=store.save, args=(StoredResponse(response("resp_t"), []),))
    worker.start()
    worker.join()
    assert store.load("resp_t") is not None and other.load("resp_t") is None
    store.close()
    other.close()


def test_f2_async_store_runs_on_its_own_thread(tmp_path: Path) -> None:
    async_store = AsyncResponseStore.open(tmp_path / "r.sqlite3")
    seen: list[str] = []

    def where() -> str:
        seen.append(threading.current_thread().name)
        return seen[-1]

    async def main() -> StoredResponse | None:
        await async_store.save(StoredResponse(response("resp_x"), CONVERSATION))
        await asyncio.wrap_future(async_store.submit(where))
        return await async_store.load("resp_x")

    loaded = asyncio.run(main())
    assert loaded is not None and loaded.conversation == CONVERSATION
    assert seen[0].startswith("mlxcel-responses") and seen[0] != threading.current_thread().name
    async_store.close()
