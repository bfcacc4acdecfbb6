"""What the entry point sends a replica and what comes back, as plain picklable data (spec X).

An `HttpCall` is one HTTP request, already read and authenticated at the entry; a replica
answers it with one `ResponseStart` and then the body as bytes chunks, exactly as its own
app produced them (status, headers and envelopes unchanged, streams chunk by chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field

Headers = tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True, slots=True)
class RoutingKey:
    """What the router needs: a stickiness key (when the client named a conversation) and the text head."""

    sticky: str | None = None
    prefix: str = ""
    pinned_replica: str | None = None  # fan-out calls (/health, /slots, /metrics) name their replica


@dataclass(frozen=True, slots=True)
class HttpCall:
    method: str
    path: str
    query: bytes
    headers: Headers
    body: bytes
    routing: RoutingKey = field(default_factory=RoutingKey)


@dataclass(frozen=True, slots=True)
class ResponseStart:
    status: int
    headers: Headers
    replica: str  # the replica's id, surfaced as X-Mlxcel-Replica
