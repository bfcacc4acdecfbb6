"""Issue 44: the engine process's link sends a step's events even when one of them cannot be pickled.

The event that cannot cross becomes its request's error event (and the request is aborted in the core);
the others of the batch arrive unchanged, over a real pipe. The core here only records aborts: the link's
send path is what is under test, and it calls nothing else of the core.
"""

from __future__ import annotations

import pickle
import threading
from multiprocessing import Pipe

from mlxcel.engine.remote import EngineLink
from mlxcel.types import FinishReason, TokenEvent, TokenLogprob


class AbortRecorder:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_an_event_that_cannot_be_pickled_fails_its_request_alone() -> None:
    ours, theirs = Pipe()
    core = AbortRecorder()
    link = EngineLink(core, theirs)  # type: ignore[arg-type]
    lock = threading.Lock()  # a lock cannot be pickled: it stands for any value that cannot cross
    bad = TokenEvent("bad", (7,), (TokenLogprob(7, -0.1, top=((7, lock),)),))  # type: ignore[arg-type]
    good = [TokenEvent("a", (1,)), TokenEvent("b", (2,), finish_reason=FinishReason.LENGTH)]
    link.send_batch([good[0], bad, good[1]])
    kind, events = pickle.loads(ours.recv_bytes())
    assert kind == "events" and [e.request_id for e in events] == ["a", "bad", "b"]
    assert events[0] == good[0] and events[2] == good[1]
    assert events[1].finish_reason is FinishReason.ERROR and "internal error" in (events[1].error or "")
    assert core.aborted == ["bad"]
