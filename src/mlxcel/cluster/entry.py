"""The cluster's one HTTP entry point (spec X): auth and body limits, then a replica answers.

Every route of `serve` is forwarded whole to one replica chosen by the request router and the
replica's answer is relayed unchanged, chunk by chunk (so SSE streams stream). The routes that
describe the whole cluster are answered from every replica at once: `/health` (any replica
with a free slot makes the cluster healthy), `/v1/models` (the union), `/metrics` (each
replica's samples with a `replica` label, plus the router's counts) and `/slots` (cluster-wide
slot ids). A replica that dies mid-request fails only that request, in its protocol's envelope.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, replace
from typing import Any

from mlxcel.api.errors import ApiError, Protocol, error_body, unavailable
from mlxcel.cluster.routing import routing_key
from mlxcel.cluster.wire import Headers, HttpCall, ResponseStart, RoutingKey
from mlxcel.server.routes import ROUTES

log = logging.getLogger("mlxcel.cluster")

REPLICA_HEADER = b"x-mlxcel-replica"
FAN_OUT_TIMEOUT_S = 30.0
_ANTHROPIC_PATHS = frozenset(path for route in ROUTES if route.protocol == "anthropic" for path in route.paths)
_SECRET_HEADERS = frozenset((b"authorization", b"x-api-key"))  # checked here; never sent on to replicas
# Raw ASGI (only server/ imports the web framework): the three callables' types.
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s.*)$")


class NoReplicaError(Exception):
    """Every replica is down (Ray is starting replacements)."""


@dataclass(frozen=True, slots=True)
class Answer:
    """One replica's whole (non-streamed) reply to a fan-out call."""

    start: ResponseStart
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class ClusterEntry:
    """The ASGI app behind the Gate: `handle` is the engine deployment's Ray Serve handle."""

    def __init__(self, handle: Any, replicas: Callable[[], list[str | None]],
                 cluster_metrics: Callable[[], str]) -> None:
        self._handle = handle
        self._stream_handle = handle.options(stream=True)
        self._replicas = replicas  # live replica ids; [None] when the router cannot list them
        self._cluster_metrics = cluster_metrics
        self._fan_out: dict[tuple[str, str], Callable[[HttpCall], Awaitable[Answer]]] = {
            ("GET", "/"): self._health, ("GET", "/health"): self._health, ("GET", "/v1/health"): self._health,
            ("GET", "/v1/models"): self._models, ("GET", "/models"): self._models,
            ("GET", "/metrics"): self._metrics, ("GET", "/slots"): self._slots,
            ("POST", "/v1/cache/reset"): self._cache_reset,
            ("PATCH", "/v1/settings"): self._broadcast, ("PATCH", "/settings"): self._broadcast,  # F9: every replica
            ("POST", "/v1/chat/completions/control"): self._owner, ("POST", "/chat/completions/control"): self._owner,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan is off; WebSocket routes (/v1/realtime) are not served by a cluster
        protocol: Protocol = "anthropic" if scope["path"] in _ANTHROPIC_PATHS else "openai"
        try:
            call = await _read_call(scope, receive)
        except ApiError as exc:  # 413 while the body streamed in, 408 on a stalled body
            await _send_error(send, exc, protocol)
            return
        if call is None:
            return  # the client left before its body was complete: nothing to answer
        aggregate = self._fan_out.get((call.method, call.path))
        if aggregate is None and call.method == "POST" and call.path.startswith("/slots/"):
            aggregate = self._slot_action
        if aggregate is not None:
            await _send_answer(send, await self._guarded(aggregate, call, protocol))
            return
        await self._forward(call, receive, send, protocol)

    # ---- forwarding ----

    async def _forward(self, call: HttpCall, receive: Receive, send: Send, protocol: Protocol) -> None:
        if not self._replicas():  # all replicas down: Ray would hold the request until one is back
            await _send_error(send, replica_error(NoReplicaError()) or unavailable(""), protocol)
            return
        stream = self._stream_handle.handle.remote(call)
        watcher = asyncio.ensure_future(_cancel_on_disconnect(receive, stream))
        start: ResponseStart | None = None
        try:
            async for part in stream:
                if isinstance(part, ResponseStart):
                    start = part
                    await send(_start_message(part))
                else:
                    await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception as exc:  # noqa: BLE001 - a Ray failure becomes this request's error, nothing more
            await self._fail(send, exc, start, protocol)
        finally:
            watcher.cancel()

    async def _fail(self, send: Send, exc: Exception, start: ResponseStart | None, protocol: Protocol) -> None:
        error = replica_error(exc)
        if error is None:
            return  # the client left first: nobody to tell
        log.warning("request failed on its replica: %s", error.message)
        if start is None:
            await _send_error(send, error, protocol)
            return
        tail = _stream_error_frame(error, protocol) if _is_event_stream(start.headers) else b""
        with contextlib.suppress(Exception):
            await send({"type": "http.response.body", "body": tail, "more_body": False})

    # ---- fan-out routes ----

    async def _guarded(self, aggregate: Callable[[HttpCall], Awaitable[Answer]], call: HttpCall,
                       protocol: Protocol) -> Answer:
        try:
            return await aggregate(call)
        except Exception as exc:  # noqa: BLE001 - every replica failed to answer
            error = replica_error(exc) or unavailable("no replica answered")
            return _error_answer(error, protocol)

    async def _ask(self, call: HttpCall, replica: str | None) -> Answer:
        pinned = replace(call, routing=RoutingKey(pinned_replica=replica)) if replica else call
        parts = [part async for part in self._stream_handle.handle.remote(pinned)]
        start = next(part for part in parts if isinstance(part, ResponseStart))
        return Answer(start, b"".join(part for part in parts if isinstance(part, bytes)))

    async def _ask_all(self, call: HttpCall) -> list[Answer]:
        """Every live replica's answer (each replica once); failures left out, all failing raises."""
        replicas = self._replicas()
        if not replicas:
            raise NoReplicaError
        results = await asyncio.gather(*(asyncio.wait_for(self._ask(call, r), FAN_OUT_TIMEOUT_S) for r in replicas),
                                       return_exceptions=True)
        answers: dict[str, Answer] = {}
        for result in results:
            if isinstance(result, Answer):
                answers.setdefault(result.start.replica, result)
        if not answers:
            failure = next((r for r in results if isinstance(r, BaseException)), None)
            raise failure if isinstance(failure, Exception) else RuntimeError("no replica answered")
        return [answers[key] for key in sorted(answers)]

    async def _health(self, call: HttpCall) -> Answer:
        answers = await self._ask_all(call)
        return _json_answer(*merge_health([(a.start.replica, a.start.status, a.json()) for a in answers]))

    async def _models(self, call: HttpCall) -> Answer:
        answers = await self._ask_all(call)
        ok = [a for a in answers if a.start.status == 200]
        if not ok:
            return answers[0]
        body = ok[0].json()
        seen = {entry.get("id") for entry in body.get("data", [])}
        for answer in ok[1:]:
            for entry in answer.json().get("data", []):
                if entry.get("id") not in seen:
                    seen.add(entry.get("id"))
                    body["data"].append(entry)
        return _json_answer(200, body)

    async def _metrics(self, call: HttpCall) -> Answer:
        answers = await self._ask_all(call)
        if any(a.start.status != 200 for a in answers):  # --metrics off: each replica's own 501
            return next(a for a in answers if a.start.status != 200)
        text = merge_metrics([(a.start.replica, a.body.decode("utf-8")) for a in answers]) + self._cluster_metrics()
        start = ResponseStart(200, ((b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),), "cluster")
        return Answer(start, text.encode("utf-8"))

    async def _slots(self, call: HttpCall) -> Answer:
        answers = await self._ask_all(call)
        ok = [a for a in answers if a.start.status == 200]
        if not ok:
            return answers[0]
        return _json_answer(200, merge_slots([(a.start.replica, a.json()) for a in ok]))

    async def _slot_action(self, call: HttpCall) -> Answer:
        """POST /slots/{cluster id}: the owning replica's slot action, under its own slot id."""
        listing = await self._ask_all(replace(call, method="GET", path="/slots", query=b"", body=b""))
        owner = find_slot(call.path.removeprefix("/slots/"),
                          [(a.start.replica, a.json()) for a in listing if a.start.status == 200])
        if owner is None:
            return await self._ask(call, listing[0].start.replica)  # its own 400/404 for a bad id
        replica, local_id = owner
        return await self._ask(replace(call, path=f"/slots/{local_id}"), replica)

    async def _broadcast(self, call: HttpCall) -> Answer:
        answers = await self._ask_all(call)
        return next((a for a in answers if a.start.status >= 400), answers[0])

    async def _cache_reset(self, call: HttpCall) -> Answer:
        """Every replica resets; the reply sums what they dropped (issue 29: host and disk tiers too)."""
        answers = await self._ask_all(call)
        failed = next((a for a in answers if a.start.status >= 400), None)
        return failed or _json_answer(200, merge_cache_reset([a.json() for a in answers]))

    async def _owner(self, call: HttpCall) -> Answer:
        """A control call for a running completion: only the replica running it knows its id."""
        answers = await self._ask_all(call)
        return next((a for a in answers if a.start.status < 400), answers[0])


# ---- merging (pure) ----

def merge_health(answers: list[tuple[str, int, dict[str, Any]]]) -> tuple[int, dict[str, Any]]:
    """K1 over the cluster: sums of the batch and counters; ok while any replica has a free slot."""
    healthy = [body for _, status, body in answers if status == 200]
    body = dict(healthy[0] if healthy else answers[0][2])
    for group in ("batch", "observability"):
        body[group] = {name: sum(int(b.get(group, {}).get(name, 0)) for _, _, b in answers)
                       for name in answers[0][2].get(group, {})}
    body["replicas"] = [{"replica": replica, "status": b.get("status"), "batch": b.get("batch")}
                        for replica, _, b in answers]
    return (200 if healthy else 503), body


def merge_metrics(texts: list[tuple[str, str]]) -> str:
    """Prometheus text of several replicas as one exposition: families once, samples labelled."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for replica, text in texts:
        current: str | None = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                current = line.split(" ", 3)[2]
                meta, _ = families.setdefault(current, ([], []))
                if line not in meta:
                    meta.append(line)
            elif line and not line.startswith("#"):
                family = families.setdefault(current or line.split("{")[0].split(" ")[0], ([], []))
                family[1].append(_labelled(line, replica))
    return "".join("\n".join(meta + samples) + "\n" for meta, samples in families.values())


def _labelled(line: str, replica: str) -> str:
    match = _SAMPLE.match(line)
    if match is None:
        return line
    name, labels, rest = match.groups()
    inner = labels[1:-1] if labels else ""
    label = f'replica="{replica}"'
    return f"{name}{{{label}{',' + inner if inner else ''}}}{rest}"


def cluster_metrics(replicas: list[str], routed: Any) -> str:
    """The router's view: live replicas and requests routed by replica and reason."""
    lines = ["# HELP mlxcel_cluster_replicas Replicas the request router can route to.",
             "# TYPE mlxcel_cluster_replicas gauge", f"mlxcel_cluster_replicas {len(replicas)}",
             "# HELP mlxcel_cluster_routed_total Requests routed, by replica and routing reason.",
             "# TYPE mlxcel_cluster_routed_total counter"]
    lines += [f'mlxcel_cluster_routed_total{{replica="{replica}",reason="{reason}"}} {count}'
              for (replica, reason), count in sorted(routed.items())]
    return "\n".join(lines) + "\n"


def merge_slots(answers: list[tuple[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Every replica's slots, numbered across the cluster (replica order is stable: sorted ids)."""
    merged: list[dict[str, Any]] = []
    for replica, slots in answers:
        for slot in slots:
            merged.append({**slot, "id": len(merged), "replica": replica, "replica_slot_id": slot.get("id")})
    return merged


def merge_cache_reset(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """The replicas' reset replies as one: reset when any reset, each tier's drops summed."""
    body = dict(answers[0])
    body["enabled"] = any(a.get("enabled") for a in answers)
    body["reset"] = any(a.get("reset") for a in answers)
    names = answers[0].get("dropped", {})
    body["dropped"] = {name: sum(int(a.get("dropped", {}).get(name, 0)) for a in answers) for name in names}
    return body


def find_slot(cluster_id: str, answers: list[tuple[str, list[dict[str, Any]]]]) -> tuple[str, int] | None:
    if not cluster_id.isdigit():
        return None
    for slot in merge_slots(answers):
        if slot["id"] == int(cluster_id):
            return slot["replica"], int(slot["replica_slot_id"])
    return None


# ---- ASGI plumbing ----

async def _read_call(scope: Scope, receive: Receive) -> HttpCall | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    headers: Headers = tuple((bytes(k).lower(), bytes(v)) for k, v in scope["headers"]
                             if bytes(k).lower() not in _SECRET_HEADERS)
    body = b"".join(chunks)
    return HttpCall(scope["method"], scope["path"], scope.get("query_string", b""), headers, body,
                    routing_key(headers, body))


async def _cancel_on_disconnect(receive: Receive, stream: Any) -> None:
    """The client left: cancel the replica's work (it aborts the generation) instead of finishing it."""
    while (await receive())["type"] != "http.disconnect":
        pass
    stream.cancel()


def replica_error(exc: BaseException) -> ApiError | None:
    """A Ray failure as the error the client gets; None when the request was cancelled by its client."""
    from ray import exceptions as ray_errors
    from ray.serve.exceptions import RequestCancelledError

    if isinstance(exc, (RequestCancelledError, asyncio.CancelledError, ray_errors.TaskCancelledError)):
        return None
    if isinstance(exc, NoReplicaError):
        return unavailable("no replica is running; Ray is starting them", 5)
    if isinstance(exc, (ray_errors.ActorDiedError, ray_errors.ActorUnavailableError, ray_errors.RayActorError)):
        return unavailable("the replica serving this request stopped; retry (another replica will answer)", 1)
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return unavailable("no replica answered in time", 1)
    log.error("replica call failed: %r", exc)
    return ApiError(500, "internal server error; see the server log", "server_error", code=500)


def _error_answer(error: ApiError, protocol: Protocol) -> Answer:
    headers = ((b"content-type", b"application/json"),) + tuple(
        (k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in error.headers.items())
    return Answer(ResponseStart(error.status, headers, "cluster"), json.dumps(error_body(error, protocol)).encode())


def _json_answer(status: int, body: Any) -> Answer:
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return Answer(ResponseStart(status, ((b"content-type", b"application/json"),), "cluster"), data)


async def _send_error(send: Send, error: ApiError, protocol: Protocol) -> None:
    await _send_answer(send, _error_answer(error, protocol))


async def _send_answer(send: Send, answer: Answer) -> None:
    await send(_start_message(replace(answer.start, headers=tuple(
        (k, v) for k, v in answer.start.headers if k != b"content-length")), len(answer.body)))
    await send({"type": "http.response.body", "body": answer.body, "more_body": False})


def _start_message(start: ResponseStart, content_length: int | None = None) -> dict[str, Any]:
    headers = [(k, v) for k, v in start.headers if k != REPLICA_HEADER]
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode()))
    headers.append((REPLICA_HEADER, start.replica.encode("latin-1")))
    return {"type": "http.response.start", "status": start.status, "headers": headers}


def _is_event_stream(headers: Headers) -> bool:
    return any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


def _stream_error_frame(error: ApiError, protocol: Protocol) -> bytes:
    """A stream cut by a dead replica ends with one error event in its protocol's shape."""
    data = json.dumps(error_body(error, protocol))
    return f"event: error\ndata: {data}\n\n".encode() if protocol == "anthropic" else f"data: {data}\n\n".encode()
