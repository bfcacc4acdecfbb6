"""The engine core in a process of its own (issue 25, `--engine-process on`).

The API process keeps HTTP, templates, tokenization, detokenization and stop strings; the child
owns the model, scheduler, KV cache and sampler (an `EngineCore` on its main thread). They talk
over one pipe of pickled messages:

    API -> engine: ("add", Request) ("abort", id) ("command", n, name, args) ("stats", n)
                   ("config", EngineConfig) ("stop",)
    engine -> API: ("ready", EngineInfo) ("load_error", exception) ("events", [TokenEvent, ...])
                   ("reply", n, ok, value) ("stopped", clean)

An engine step's events travel as one message (the core's flush hook), not one per token, so
the API process wakes once per step and its per-token work never holds the engine's GIL.
`RemoteCore` is the API side: the calls `EngineClient` makes of an `EngineCore`.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from mlxcel.config import EngineConfig
from mlxcel.engine.admission import MemoryBudget
from mlxcel.engine.loop import EngineCore, Sink, admit
from mlxcel.types import (
    EngineError, EngineShutdownError, EngineStats, FinishReason, MtpDecision, QueueFullError, Request, TokenEvent,
)

log = logging.getLogger(__name__)

STATS_TIMEOUT_S = 10.0  # a /metrics or /slots read waits at most this long for the engine process
Spawn = Callable[[], "tuple[BaseProcess, Connection]"]  # starts an engine process: (process, our pipe end)


class EngineProcessError(EngineError):
    """The engine process died or could not start."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the API process needs of the engine once it is built (sent with "ready")."""

    config: EngineConfig  # fitted to the model (one slot for a family that cannot batch, ...)
    slot_context: int
    memory_budget: MemoryBudget
    eos_token_ids: frozenset[int]
    lora_adapters: tuple[tuple[str, float], ...]  # the loaded adapters' paths and scales (F8)
    mtp: MtpDecision | None
    pid: int
    # issue 43: a vision-language model's ImagePrompter, pickled by the engine process with its tokenizer
    # left out (serving.engine_process rebuilds it over the API process's); None for a text-only model
    image_prompter: bytes | None = None


# ---- the API process's side ----


class RemoteCore:
    """The API process's stand-in for an EngineCore that runs in `process` (issue 25)."""

    drafts = None  # the draft policy lives in the engine process (ServedModel.mtp reads EngineInfo's)

    def __init__(self, process: BaseProcess, conn: Connection, info: EngineInfo,
                 respawn: Spawn | None = None) -> None:
        self._process = process
        self._conn = conn
        self._config = info.config
        self.slot_context = info.slot_context
        self.memory_budget = info.memory_budget
        self.eos_token_ids = info.eos_token_ids
        self.info = info
        self.failure: BaseException | None = None
        self._sinks: dict[str, Sink] = {}  # unfinished requests: admission counts them
        self._replies: dict[int, Future] = {}
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._is_stopping = False
        self._respawn = respawn  # issue 44: how a new engine process is started when this one dies
        self.is_recovering = False  # a new engine process is starting: 503 meanwhile, not the server's end
        # NOTE: named _thread as EngineCore's loop thread is: the cluster replica watches it
        self._thread = threading.Thread(target=self._read, name="mlxcel-engine-reader", daemon=True)
        self._thread.start()
        self._last_stats: EngineStats = self._fetch_stats()
        atexit.register(self._kill_at_exit)  # before multiprocessing's own exit hook joins the process

    def _kill_at_exit(self) -> None:
        """An API process that exits without stop() (a startup error) takes its engine process along."""
        if self._process.is_alive():
            self._is_stopping = True
            self._process.kill()

    @property
    def config(self) -> EngineConfig:
        return self._config

    @config.setter
    def config(self, value: EngineConfig) -> None:  # EngineClient.reconfigure (F9): both sides see it
        self._config = value
        self._send(("config", value))

    @property
    def is_alive(self) -> bool:
        return self.failure is None

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def submit(self, request: Request, sink: Sink) -> None:
        with self._lock:
            if self.failure is not None:
                raise EngineShutdownError("the engine process stopped after an error; see the server log")
            if self._is_stopping:
                raise EngineShutdownError("the server is shutting down")
            admit(request, self._config, self.slot_context, self.memory_budget)
            if len(self._sinks) >= self._config.max_num_seqs + self._config.max_queue_depth:
                raise QueueFullError(f"the request queue is full ({self._config.max_queue_depth} waiting)")
            try:
                message = pickle.dumps(("add", request), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # noqa: BLE001 - a per-request plug-in that cannot cross
                raise ValueError(f"this request cannot be handed to the engine process (--engine-process on): "
                                 f"{_plugins(request)} cannot be copied ({exc})") from None
            self._sinks[request.request_id] = sink
        self._send_bytes(message)

    def abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except EngineShutdownError:
            pass  # the process is gone: the reader fails every request in flight

    def command(self, name: str, *args: Any) -> Future:
        if name not in EngineCore.COMMANDS:
            raise ValueError(f"unknown engine command {name!r}")
        number, future = self._reply_slot()
        self._send(("command", number, name, args))
        return future

    def call(self, fn: Callable[[], Any]) -> Future:
        raise EngineProcessError("the engine runs in its own process (--engine-process on): only named commands "
                                 "cross to it")

    def stats(self) -> EngineStats:
        if self.failure is not None or self._is_stopping:
            return _dead(self._last_stats) if self.failure is not None else self._last_stats
        try:
            self._last_stats = self._fetch_stats()
        except Exception:  # noqa: BLE001 - the reader fails the future when the process died
            log.warning("engine process: no stats within %.0f s", STATS_TIMEOUT_S)
        return self._last_stats if self.failure is None else _dead(self._last_stats)

    def _fetch_stats(self) -> EngineStats:
        number, future = self._reply_slot()
        try:
            self._send(("stats", number))
            return future.result(STATS_TIMEOUT_S)
        finally:
            with self._lock:
                self._replies.pop(number, None)

    def stop(self, timeout: float = 120.0) -> bool:
        """Drain (abort in flight, the disk tier's flush) and wait up to `timeout` for the engine process
        to exit (0: only ask, as the server does first); True once it exited cleanly."""
        if not self._is_stopping:
            self._is_stopping = True
            try:
                self._send(("stop",))
            except EngineShutdownError:
                pass  # already gone
        if reap(self._process, timeout) is None:
            return False
        self._thread.join(5)
        return self._process.exitcode == 0

    def _reply_slot(self) -> tuple[int, Future]:
        future: Future = Future()
        with self._lock:
            if self.failure is not None:
                raise EngineShutdownError("the engine process stopped after an error; see the server log")
            number = next(self._numbers)
            self._replies[number] = future
        return number, future

    def _send(self, message: tuple) -> None:
        self._send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _send_bytes(self, data: bytes) -> None:
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except OSError as exc:  # the process is gone: the reader fails what is in flight
            raise EngineShutdownError(f"the engine process is gone ({exc})") from None

    # ---- the reader thread ----

    def _read(self) -> None:
        while True:
            try:
                data = self._conn.recv_bytes()
            except (EOFError, OSError):
                break
            try:
                self._dispatch(pickle.loads(data))
            except Exception:  # noqa: BLE001 - issue 44: one bad message never ends the link
                log.exception("engine process: a message (%d bytes) could not be read; skipped", len(data))
        reap(self._process, 30 if self._is_stopping else 2)  # a stopping process may still be tearing down
        self._gone()

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "events":
            self._deliver(message[1])
        elif kind == "reply":
            self._answer(*message[1:])
        elif kind == "stopped":
            log.info("engine process %s stopped (%s)", self._process.pid, "clean" if message[1] else "after an error")

    def _deliver(self, events: list[TokenEvent]) -> None:
        for event in events:
            try:
                self._deliver_one(event)
            except Exception:  # noqa: BLE001 - issue 44: this request fails; the others' events go on
                log.exception("engine process: an event of request %s could not be handed over; failing it",
                              getattr(event, "request_id", "?"))
                self._fail_request(getattr(event, "request_id", None))

    def _deliver_one(self, event: TokenEvent) -> None:
        with self._lock:
            sink = self._sinks.get(event.request_id)
            if event.finish_reason is not None:
                self._sinks.pop(event.request_id, None)
        if sink is not None:
            sink(event)

    def _fail_request(self, request_id: str | None) -> None:
        """End one request whose event could not be handed over: an error to its sink, an abort to the engine."""
        with self._lock:
            sink = self._sinks.pop(request_id, None) if request_id is not None else None
        if sink is None:
            return
        self.abort(request_id)  # type: ignore[arg-type]
        try:
            sink(TokenEvent(request_id, (), finish_reason=FinishReason.ERROR,  # type: ignore[arg-type]
                            error="internal error handing over this request's output; see the server log"))
        except Exception:  # noqa: BLE001 - its sink is what broke: its decode timeout ends it
            log.exception("engine process: request %s could not be told of its failure", request_id)

    def _answer(self, number: int, is_ok: bool, value: Any) -> None:
        with self._lock:
            future = self._replies.pop(number, None)
        if future is None:
            return  # its caller gave up waiting
        if is_ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def _gone(self) -> None:
        """The pipe closed: after stop() that is the end; otherwise the engine process died, and every
        request it held gets an error saying so before a new engine process is started (issue 44)."""
        code = self._process.exitcode
        reason = f"the engine process (pid {self._process.pid}) exited with code {code}"
        will_restart = not self._is_stopping and self._respawn is not None
        if not (self._is_stopping and code == 0):
            if self._is_stopping:  # a drain that did not end cleanly: the server's exit code says so (1)
                log.error("%s while stopping", reason)
            else:
                log.critical("%s; failing every request in flight%s", reason,
                             "; starting a new engine process" if will_restart else "")
            with self._lock:
                self.is_recovering = will_restart  # before `failure`: the server must not take it for its end
                self.failure = EngineProcessError(reason)
        self._fail_in_flight(f"{reason}; see the server log")
        if will_restart:
            self._restart()

    def _fail_in_flight(self, message: str) -> None:
        with self._lock:
            sinks, self._sinks = self._sinks, {}
            replies, self._replies = self._replies, {}
        for request_id, sink in sinks.items():
            try:
                sink(TokenEvent(request_id, (), finish_reason=FinishReason.ERROR, error=message, error_status=503))
            except Exception:  # noqa: BLE001 - one broken sink must not keep the rest unanswered
                log.exception("engine process: request %s could not be told of the failure", request_id)
        for future in replies.values():
            future.set_exception(EngineShutdownError(message))

    def _restart(self) -> None:
        """Start a new engine process in place of the dead one (on the old reader thread, whose pipe is
        closed); a failed start leaves the core dead, and the server then exits 1 as before."""
        assert self._respawn is not None
        try:
            process, conn = self._respawn()
            info = wait_info(process, conn)
        except BaseException:  # noqa: BLE001 - logged; the server sees a dead engine and stops
            log.exception("engine process: the new engine process did not start")
            self.is_recovering = False
            return
        if self._is_stopping:  # the server began stopping meanwhile: the new process goes too
            process.kill()
            self.is_recovering = False
            return
        self._process, self._conn, self.info = process, conn, info
        self._thread = threading.Thread(target=self._read, name="mlxcel-engine-reader", daemon=True)
        self._thread.start()
        self._send(("config", self._config))  # a run-time change (F9) made before the crash holds for the new one
        with self._lock:
            self.failure = None
            self.is_recovering = False
        log.warning("engine process: pid %d ready in place of the dead one; serving again", info.pid)


def reap(process: BaseProcess, timeout: float) -> int | None:
    """The process's exit code once it exited within `timeout` (None: still running). stop() and the reader
    thread both wait for the engine process: the one whose waitpid loses the race sees no code for a moment
    (ECHILD) until the other records it, which read as an unclean exit (code None, the server's exit 1)."""
    process.join(timeout)
    deadline = time.monotonic() + 5
    while process.exitcode is None and not _running(process) and time.monotonic() < deadline:
        time.sleep(0.001)
    return process.exitcode


def _running(process: BaseProcess) -> bool:
    """Whether the process has not exited yet (its sentinel not ready), whoever reaps it."""
    return not wait([process.sentinel], 0)


def _plugins(request: Request) -> str:
    names = sorted({type(p).__name__ for p in request.processors})
    return f"its token processors ({', '.join(names)})" if names else "the request"


def _dead(stats: EngineStats) -> EngineStats:
    return replace(stats, is_alive=False)


def wait_ready(process: BaseProcess, conn: Connection, respawn: Spawn | None = None) -> RemoteCore:
    """Wait for the engine process to load and warm up; its load error is raised here. With `respawn`, a
    dead engine process is replaced by a new one from it (issue 44)."""
    info = wait_info(process, conn)
    try:
        return RemoteCore(process, conn, info, respawn)
    except BaseException:
        process.kill()
        raise


def wait_info(process: BaseProcess, conn: Connection) -> EngineInfo:
    """The engine process's EngineInfo once it is ready; its load error is raised here."""
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            process.join(5)
            raise EngineProcessError(f"the engine process exited with code {process.exitcode} while loading the "
                                     f"model; see the log above") from None
        if message[0] == "ready":
            return message[1]
        if message[0] == "load_error":
            process.join(30)
            raise message[1]


# ---- the engine process's side ----


class EngineLink:
    """The engine process's end of the pipe: feeds the core's inbox and sends its events in batches."""

    def __init__(self, core: EngineCore, conn: Connection) -> None:
        self.core = core
        self._conn = conn
        self._send_lock = threading.Lock()

    def send(self, message: tuple) -> None:
        try:
            data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - issue 44: an event that cannot cross fails its request alone
            if message[0] != "events":
                raise
            data = pickle.dumps(("events", self._picklable(message[1])), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except OSError:
            pass  # the API process is gone; the reader below stops the core

    def _picklable(self, events: list[TokenEvent]) -> list[TokenEvent]:
        """The batch with each event that cannot be pickled replaced by its request's error (and aborted)."""
        kept: list[TokenEvent] = []
        for event in events:
            try:
                pickle.dumps(event, protocol=pickle.HIGHEST_PROTOCOL)
                kept.append(event)
            except Exception:  # noqa: BLE001 - logged with the request id
                log.exception("engine process: an event of request %s cannot be sent; failing it", event.request_id)
                if event.finish_reason is None:
                    self.core.abort(event.request_id)
                kept.append(TokenEvent(event.request_id, (), finish_reason=FinishReason.ERROR,
                                       error="internal error sending this request's output; see the server log"))
        return kept

    def send_one(self, event: TokenEvent) -> None:
        """The sink of every request: aborts and failures outside a flush go out at once."""
        self.send(("events", [event]))

    def send_batch(self, events: list[TokenEvent]) -> None:
        self.send(("events", events))

    def serve(self) -> None:
        """Read the API process's messages until "stop" or until it is gone (no orphan engine)."""
        self.core.flush_hook = self.send_batch
        while True:
            try:
                data = self._conn.recv_bytes()
            except (EOFError, OSError):
                log.warning("engine process: the API process is gone; stopping")
                self.core.request_stop()
                return
            try:
                if not self._handle(pickle.loads(data)):
                    return
            except Exception:  # noqa: BLE001 - issue 44: one bad message never ends the link
                log.exception("engine process: a message (%d bytes) could not be handled; skipped", len(data))

    def _handle(self, message: tuple) -> bool:
        kind = message[0]
        if kind == "add":
            self._add(message[1])
        elif kind == "abort":
            self.core.abort(message[1])
        elif kind == "command":
            _, number, name, args = message
            self.core.command(name, *args).add_done_callback(lambda f: self._reply(number, f))
        elif kind == "stats":
            self.send(("reply", message[1], True, self.core.stats()))
        elif kind == "config":
            self.core.config = message[1]
        elif kind == "stop":
            self.core.request_stop()
            return False
        return True

    def _add(self, request: Request) -> None:
        try:
            self.core.submit(request, self.send_one)
        except Exception as exc:  # noqa: BLE001 - the API process checked first; answer, never hang
            status = 503 if isinstance(exc, EngineError) else 400 if isinstance(exc, ValueError) else 500
            self.send_one(TokenEvent(request.request_id, (), finish_reason=FinishReason.ERROR, error=str(exc),
                                     error_status=status))

    def _reply(self, number: int, future: Future) -> None:
        exc = future.exception()
        if exc is not None:
            try:
                pickle.dumps(exc)
            except Exception:  # noqa: BLE001 - an error that cannot cross goes as its text
                exc = RuntimeError(str(exc))
            self.send(("reply", number, False, exc))
        else:
            self.send(("reply", number, True, future.result()))


def run_engine_process(conn: Connection, build: Callable[[], tuple[EngineCore, EngineInfo]],
                       warm: Callable[[], None]) -> int:
    """The engine process's main: build the core (a load error goes back to the API process), run
    the loop on this thread, warm up and then serve the pipe on another; the exit code."""
    try:
        core, info = build()
    except BaseException as exc:  # noqa: BLE001 - re-raised in the API process
        try:
            pickle.dumps(exc)
        except Exception:  # noqa: BLE001
            exc = EngineProcessError(f"{type(exc).__name__}: {exc}")
        try:
            conn.send_bytes(pickle.dumps(("load_error", exc), protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            pass  # the API process is gone
        return 2
    link = EngineLink(core, conn)
    core.adopt_current_thread()

    def link_main() -> None:
        try:
            warm()
        except BaseException as exc:  # noqa: BLE001 - a failed warmup is a failed start
            log.exception("engine process: warmup failed")
            link.send(("load_error", EngineProcessError(f"warmup failed: {exc}")))
            core.request_stop()
            return
        link.send(("ready", info))
        link.serve()

    threading.Thread(target=link_main, name="mlxcel-engine-link", daemon=True).start()
    core.run_on_this_thread()
    clean = core.failure is None
    link.send(("stopped", clean))
    return 0 if clean else 1


def exit_now(code: int) -> None:
    """Leave the engine process without running interpreter teardown (CUDA contexts, compile workers)."""
    logging.shutdown()
    os._exit(code)
