"""Hostile inputs over every route (issue 16): at least 500 generated malformed or adversarial
bodies against one real server (SmolLM2, port 0).

Every answer must be a 4xx JSON envelope of the route's protocol: zero 5xx, zero dropped
connections; the server is healthy after each batch and its RSS stays bounded. The figures are
printed (run with -s) and recorded in bench/RELIABILITY.md, "Hostile inputs".
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from .conftest import LiveServer

pytestmark = pytest.mark.slow

RSS_GROWTH_LIMIT = 400 * 2**20  # the 40 MB bodies are read and dropped; anything more is a leak
USER = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class JsonRoute:
    path: str
    protocol: str  # "openai" or "anthropic": the error envelope to expect
    body: dict  # a valid body, small max tokens: the base every mutation starts from
    must_fail: frozenset[str] = field(default_factory=frozenset)  # fields whose removal is a 400


ROUTES = (
    JsonRoute("/v1/chat/completions", "openai", {"messages": USER, "max_tokens": 2, "temperature": 0.0, "seed": 1,
                                                  "top_p": 0.9, "n": 1, "stop": ["x"]}, frozenset({"messages"})),
    JsonRoute("/v1/chat/completions/input_tokens", "openai", {"messages": USER}, frozenset({"messages"})),
    JsonRoute("/v1/completions", "openai", {"prompt": "hi", "max_tokens": 2, "temperature": 0.0, "logprobs": 1,
                                            "echo": False}, frozenset({"prompt"})),
    JsonRoute("/completion", "openai", {"prompt": "hi", "n_predict": 2, "temperature": 0.0, "top_k": 4, "n_probs": 1,
                                        "seed": 3}, frozenset({"prompt"})),
    JsonRoute("/infill", "openai", {"input_prefix": "def f(", "input_suffix": "):", "n_predict": 2, "temperature": 0.0}),
    JsonRoute("/tokenize", "openai", {"content": "hi", "add_special": False, "with_pieces": True},
              frozenset({"content"})),
    JsonRoute("/detokenize", "openai", {"tokens": [1, 2, 3]}),
    JsonRoute("/apply-template", "openai", {"messages": USER, "add_generation_prompt": True}, frozenset({"messages"})),
    JsonRoute("/v1/responses", "openai", {"input": "hi", "max_output_tokens": 2, "temperature": 0.0, "store": False},
              frozenset({"input"})),
    JsonRoute("/v1/responses/input_tokens", "openai", {"input": "hi"}),
    JsonRoute("/v1/messages", "anthropic", {"model": "claude-test", "max_tokens": 2, "messages": USER},
              frozenset({"messages", "max_tokens"})),
    JsonRoute("/v1/messages/count_tokens", "anthropic", {"model": "claude-test", "messages": USER},
              frozenset({"messages"})),
    JsonRoute("/v1/chat/completions/control", "openai", {"id": "chatcmpl-none", "action": "end_reasoning"},
              frozenset({"id", "action"})),
)
# Values of every JSON type; each field gets those whose type differs from its own.
WRONG_VALUES: tuple[object, ...] = ("text", 7, 2.5, True, None, [], {"a": 1}, [[1], {"b": None}])
HUGE_NUMBERS = (10**30, -(10**30), 2**64, -(2**63) - 1, 1e308, -1e308)


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str
    protocol: str
    raw: bytes | None = None  # sent as is with Content-Type JSON
    body: object = None  # else sent as JSON
    content_type: str = "application/json"
    must_be_4xx: bool = True


def _json(route: JsonRoute, name: str, body: object, must_be_4xx: bool = True) -> Case:
    return Case(f"{route.path} {name}", "POST", route.path, route.protocol, body=body, must_be_4xx=must_be_4xx)


def _raw(route: JsonRoute, name: str, raw: bytes, content_type: str = "application/json") -> Case:
    return Case(f"{route.path} {name}", "POST", route.path, route.protocol, raw=raw, content_type=content_type)


def _type_errors(route: JsonRoute) -> Iterator[Case]:
    for key, value in route.body.items():
        for wrong in WRONG_VALUES:
            if type(wrong) is type(value) or (wrong is None and key not in route.must_fail):
                continue  # same type (may be valid) or an optional field set to null (valid)
            if isinstance(value, float) and type(wrong) is int or key == "stop" and isinstance(wrong, str):
                continue  # an int where a float goes, a string stop: valid JSON numbers / shapes
            yield _json(route, f"{key}={json.dumps(wrong)}", {**route.body, key: wrong})


def _missing_and_shapes(route: JsonRoute) -> Iterator[Case]:
    for key in route.must_fail:
        yield _json(route, f"without {key}", {k: v for k, v in route.body.items() if k != key})
    for shape in ([], [route.body], "body", 12, None, True):
        yield _json(route, f"body is {type(shape).__name__}", shape)
    yield _raw(route, "empty body", b"")
    yield _raw(route, "whitespace body", b"  \n ")


def _numbers(route: JsonRoute) -> Iterator[Case]:
    numeric = [(k, v) for k, v in route.body.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    for key, value in numeric:
        for huge in HUGE_NUMBERS:
            if isinstance(huge, int):  # past 64 bits: refused at the body; a finite float may be valid
                yield _json(route, f"{key}={huge}", {**route.body, key: huge})
            elif isinstance(value, float):
                yield _json(route, f"{key}={huge}", {**route.body, key: huge}, must_be_4xx=False)
        for literal in (b"NaN", b"Infinity", b"-Infinity", b"9" * 5000, b"1e99999"):
            text = json.dumps({**route.body, key: "@@"}).encode().replace(b'"@@"', literal)
            yield _raw(route, f"{key}={literal[:12].decode()}", text)


def _encodings(route: JsonRoute) -> Iterator[Case]:
    base = json.dumps(route.body).encode()
    yield _raw(route, "depth 10,000", b'{"messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}")
    yield _raw(route, "depth 10,000 objects", b'{"a":' * 10_000 + b"1" + b"}" * 10_000)
    yield _raw(route, "invalid UTF-8", base[:-1] + b', "x": "\xff\xfe\xc3("}')
    yield _raw(route, "raw NUL byte", base[:-1] + b', "x": "a\x00b"}')
    yield _raw(route, "lone surrogate escape", base[:-1] + b', "messages": [{"role": "user", "content": "\\ud800"}], '
                                                          b'"prompt": "\\udfff", "input": "\\ud800", "content": "\\udc00"}')
    yield _raw(route, "raw surrogate bytes", base[:-1] + b', "prompt": "\xed\xa0\x80", "input": "\xed\xa0\x80", '
                                                        b'"content": "\xed\xa0\x80", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}')
    yield _raw(route, "truncated JSON", base[: len(base) // 2])
    yield _raw(route, "trailing garbage", base + b"}}}")
    yield _raw(route, "text/plain", base, content_type="text/plain")
    yield _raw(route, "no content type", base, content_type="")
    yield _raw(route, "UTF-16 body", json.dumps(route.body).encode("utf-16"))


def _chat_semantics(route: JsonRoute) -> Iterator[Case]:
    """Adversarial but well-formed chat bodies: roles, tools, grammars, media addresses."""
    if "messages" not in route.body:
        return
    bad_roles = ("alien", "", "SYSTEM", "user ", "tool\x00", "🤖")
    for role in bad_roles:
        yield _json(route, f"role {role!r}", {**route.body, "messages": [{"role": role, "content": "hi"}]})
    if route.protocol == "anthropic":
        yield from _anthropic_semantics(route)
        return
    bad_tools = ({"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}},
                 {"type": "function", "function": {}}, {"type": "function"},
                 {"type": "function", "function": {"name": "f", "parameters": {"properties": 5}}},
                 {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "a"}}})
    for i, tool in enumerate(bad_tools):
        yield _json(route, f"bad tool {i}", {**route.body, "tools": [tool]})
    grammars = ('root ::= "a"{1000000}', "root ::= root", "root ::= [", 'root ::= "unterminated', "x ::= y")
    for i, grammar in enumerate(grammars):
        yield _json(route, f"bad grammar {i}", {**route.body, "grammar": grammar})
    schemas = ({"$ref": "#"}, {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
               {"type": "string", "pattern": "(unclosed"}, {"type": "string", "pattern": "[z-a]"}, "not a schema")
    for i, schema in enumerate(schemas):
        yield _json(route, f"bad json_schema {i}", {**route.body, "response_format": {
            "type": "json_schema", "json_schema": {"name": "r", "schema": schema}}})
    urls = ("file:///etc/passwd", "http://127.0.0.1:1/x.png", "http://localhost/a.png", "http://[::1]/a.png",
            "http://169.254.169.254/latest/meta-data", "data:image/png;base64,!!!notbase64", "gopher://x/")
    for url in urls:
        content = [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": url}}]
        yield _json(route, f"image {url[:30]}", {**route.body, "messages": [{"role": "user", "content": content}]})


def _anthropic_semantics(route: JsonRoute) -> Iterator[Case]:
    tools = ({"name": "f", "input_schema": {"type": "objekt"}}, {"name": "", "input_schema": {"type": "object"}},
             {"name": "f", "input_schema": "x"})
    for i, tool in enumerate(tools):
        yield _json(route, f"bad tool {i}", {**route.body, "tools": [tool]})
    for url in ("file:///etc/passwd", "http://127.0.0.1:1/x.png"):
        image = {"type": "image", "source": {"type": "url", "url": url}}
        yield _json(route, f"image {url}", {**route.body, "messages": [{"role": "user", "content": [image]}]})


def _ops_cases() -> Iterator[Case]:
    for name in ("../../etc/passwd", "/etc/passwd", "..", "a/../../b", "x\x00y", "", "a" * 5000, "..\\..\\win.ini"):
        for action in ("save", "restore"):
            yield Case(f"slot {action} {name[:20]!r}", "POST", f"/slots/0?action={action}", "openai",
                       body={"filename": name})
    for slot in ("-1", "99999", "abc", "²", "9" * 5000):
        yield Case(f"slot id {slot[:12]}", "POST", f"/slots/{slot}?action=erase", "openai", body={})
    yield Case("slot bad action", "POST", "/slots/0?action=explode", "openai", body={})
    for path in ("/v1/responses/" + "x" * 5000, "/v1/responses/../../etc", "/v1/models/%00", "/nope", "/v1/../x"):
        yield Case(f"GET {path[:30]}", "GET", path, "openai")
    yield Case("DELETE unknown response", "DELETE", "/v1/responses/resp_nope", "openai")
    yield Case("wrong method", "PUT", "/v1/chat/completions", "openai", body={})
    for path in ("/v1/embeddings", "/embedding", "/v1/rerank"):  # no provider: 501 is its own answer
        yield Case(f"{path} NaN", "POST", path, "openai", raw=b'{"input": NaN}')


def _big_bodies() -> Iterator[Case]:
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (40 * 2**20) + b'"}]}'
    for path, protocol in (("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic"), ("/completion", "openai")):
        yield Case(f"{path} 40 MB", "POST", path, protocol, raw=big)


def all_cases() -> list[Case]:
    cases: list[Case] = []
    for route in ROUTES:
        for make in (_type_errors, _missing_and_shapes, _numbers, _encodings, _chat_semantics):
            cases.extend(make(route))
    cases.extend(_ops_cases())
    cases.extend(_big_bodies())
    return cases


@dataclass
class Tally:
    num_tried: int = 0
    num_5xx: int = 0
    num_dropped: int = 0
    statuses: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)


def send(http: httpx.Client, case: Case) -> httpx.Response:
    headers = {"content-type": case.content_type} if case.content_type else {}
    if case.raw is not None:
        return http.request(case.method, case.path, content=case.raw, headers=headers)
    if case.method in ("GET", "DELETE"):
        return http.request(case.method, case.path)
    return http.request(case.method, case.path, content=json.dumps(case.body).encode(), headers=headers)


def check(case: Case, response: httpx.Response, tally: Tally) -> None:
    tally.statuses[response.status_code] += 1
    if response.status_code >= 500 and response.status_code != 501:
        tally.num_5xx += 1
        tally.problems.append(f"{case.name}: {response.status_code} {response.text[:200]}")
        return
    if case.must_be_4xx and not 400 <= response.status_code < 502:
        tally.problems.append(f"{case.name}: expected 4xx, got {response.status_code} {response.text[:120]}")
        return
    if response.status_code >= 400 and not _is_envelope(case.protocol, response):
        tally.problems.append(f"{case.name}: not a {case.protocol} error envelope: {response.text[:200]}")


def _is_envelope(protocol: str, response: httpx.Response) -> bool:
    try:
        body = response.json()
    except ValueError:
        return False
    if protocol == "anthropic" and body.get("type") == "error":
        return isinstance(body.get("error", {}).get("message"), str)
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str)


def run_cases(server: LiveServer, cases: list[Case], batch_size: int = 100) -> Tally:
    tally = Tally()
    with httpx.Client(base_url=server.address, timeout=120) as http:
        for start in range(0, len(cases), batch_size):
            for case in cases[start:start + batch_size]:
                tally.num_tried += 1
                try:
                    check(case, send(http, case), tally)
                except httpx.TransportError as exc:
                    tally.num_dropped += 1
                    tally.problems.append(f"{case.name}: connection dropped ({exc!r})")
            assert server.is_healthy(), f"unhealthy after the batch ending at case {start + batch_size}"
    return tally


def test_issue16_hostile_inputs_every_route(live_server: LiveServer) -> None:
    cases = all_cases()
    assert len(cases) >= 500
    rss_before = live_server.rss_bytes()
    tally = run_cases(live_server, cases)
    rss_after = live_server.rss_bytes()
    print(f"\nhostile inputs: {tally.num_tried} tried, {tally.num_5xx} 5xx, {tally.num_dropped} dropped, "
          f"statuses {dict(sorted(tally.statuses.items()))}, RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB")
    assert not tally.problems, "\n".join(tally.problems[:40])
    assert tally.num_5xx == 0 and tally.num_dropped == 0
    assert rss_after - rss_before < RSS_GROWTH_LIMIT
    stats = live_server.state.served.engine.stats()
    assert stats.active_sequences == 0 and stats.queue_depth == 0
