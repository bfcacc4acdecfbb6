"""Schema-driven fuzzing of the served /openapi.json with schemathesis (issue 16), bounded.

Every operation of the schema the server itself serves gets a few bodies that fit it and a few
that break it (schemathesis' positive and negative modes). Any answer is fine but a 5xx (501,
a feature this process does not serve, excepted), a dropped connection, or an error that is
not a JSON envelope. Generation is kept short: a generated body's length limits are capped at a
few tokens and `n` at 1 before it is sent, so the run stays within CI's budget.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode

from mlxcel.server.routes import ROUTES

from .conftest import LiveServer

pytestmark = pytest.mark.slow

EXAMPLES_PER_MODE = 3
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens")
SKIPPED_PATHS = ("/v1/audio/", "/audio/")  # multipart bodies; no audio model in this process
PRIMARY_PATHS = frozenset(route.paths[0].replace(":path}", "}") for route in ROUTES)


def bounded_body(body: object) -> object:
    """A generated body with its generation cut short (a fuzzer's max_tokens can be 10^18)."""
    if not isinstance(body, dict):
        return body
    capped = dict(body)
    if not any(name in capped for name in LENGTH_FIELDS):  # absent: until the context is full
        capped.update({name: 4 for name in LENGTH_FIELDS})
    for name in LENGTH_FIELDS:
        value = capped.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and (value > 4 or value < 0):
            capped[name] = 4
    if "n" in capped and isinstance(capped["n"], int) and not isinstance(capped["n"], bool):
        capped["n"] = 1
    if isinstance(capped.get("prompt"), list) and len(capped["prompt"]) > 4:
        capped["prompt"] = capped["prompt"][:4]
    return capped


def test_issue16_schemathesis_over_the_served_openapi(live_server: LiveServer) -> None:
    raw = httpx.get(live_server.address + "/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(raw)
    statuses: Counter = Counter()
    problems: list[str] = []
    num_operations = 0
    timings: dict[str, float] = {}
    with httpx.Client(base_url=live_server.address, timeout=120) as http:
        for result in schema.get_all_operations():
            operation = result.ok()
            if operation.path.startswith(SKIPPED_PATHS) or operation.path not in PRIMARY_PATHS:
                continue  # audio needs multipart; an alias runs the same handler as its primary path
            num_operations += 1
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                started = time.monotonic()
                _fuzz(operation, mode, http, statuses, problems)
                timings[f"{operation.method.upper()} {operation.path} {mode.value}"] = time.monotonic() - started
        assert live_server.is_healthy()
    total = sum(statuses.values())
    print(f"\nschemathesis: {num_operations} operations, {total} requests, statuses {dict(sorted(statuses.items()))}")
    slowest = sorted(timings.items(), key=lambda item: -item[1])[:5]
    print("slowest: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in slowest))
    assert num_operations >= 25 and total >= 100
    assert not problems, "\n".join(problems[:30])


def _fuzz(operation: object, mode: GenerationMode, http: httpx.Client, statuses: Counter, problems: list[str]) -> None:
    @settings(max_examples=EXAMPLES_PER_MODE, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))  # type: ignore[attr-defined]
    def run(case: object) -> None:
        _send(case, http, statuses, problems)

    try:
        run()
    except Unsatisfiable:
        pass  # nothing to break (a GET without parameters has no negative case)


def _send(case: object, http: httpx.Client, statuses: Counter, problems: list[str]) -> None:
    path = case.formatted_path  # type: ignore[attr-defined]
    kwargs: dict = {"params": case.query or None, "headers": {k: str(v) for k, v in (case.headers or {}).items()}}
    body = getattr(case, "body", None)
    if case.method.upper() in ("POST", "PUT", "PATCH") and not _is_unset(body):  # type: ignore[attr-defined]
        kwargs["content"] = body if isinstance(body, bytes) else json.dumps(bounded_body(body)).encode()
        kwargs["headers"]["content-type"] = "application/json"
    try:
        response = http.request(case.method.upper(), path, **kwargs)  # type: ignore[attr-defined]
    except httpx.TransportError as exc:
        problems.append(f"{case.method} {path}: connection dropped ({exc!r})")  # type: ignore[attr-defined]
        return
    except (httpx.InvalidURL, UnicodeEncodeError, ValueError):
        return  # a generated header or path the client itself cannot send
    statuses[response.status_code] += 1
    if response.status_code >= 500 and response.status_code != 501:
        problems.append(f"{case.method} {path}: {response.status_code} {response.text[:200]}")  # type: ignore
    elif response.status_code >= 400 and not _is_json(response):
        problems.append(f"{case.method} {path}: {response.status_code} is not JSON: {response.text[:120]}")


def _is_unset(body: object) -> bool:
    return body is None or type(body).__name__ == "NotSet"


def _is_json(response: httpx.Response) -> bool:
    try:
        response.json()
    except ValueError:
        return False
    return True
