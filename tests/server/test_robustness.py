"""Issue 16's defects, each through the real server on SmolLM2 (port 0, real clients).

Hostile bodies (depth, huge ints, surrogates, seeds), an engine that must survive a failing
request and report its own death, admission that does not depend on timing, requests that can
never be admitted, invalid roles / tool schemas / grammars, the OpenAPI schema, the aborted
sequence counter, and the agent loop (tool call, tool result, answer) on a template that knows
nothing of tools, through the OpenAI, Anthropic and Responses SDKs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from collections.abc import Callable, Iterator

import anthropic
import httpx
import openai
import pytest

from mlxcel.config import EngineConfig
from mlxcel.engine import loop as engine_loop
from mlxcel.serving.served_model import ServedModel
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread, bind_socket, serve
from mlxcel.server.state import ServerState

from .conftest import chat_body, engine_like, wait_until

pytestmark = pytest.mark.slow

CHAT_ROUTES = ("/v1/chat/completions", "/v1/completions", "/completion", "/infill", "/tokenize", "/detokenize",
               "/apply-template", "/v1/responses", "/v1/chat/completions/input_tokens", "/v1/embeddings")
ANTHROPIC_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")
HOSTILE_BODIES = {
    "depth 10,000": b'{"messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
    "5,000-digit int": b'{"max_tokens": ' + b"9" * 5_000 + b', "messages": [{"role": "user", "content": "hi"}]}',
    "lone surrogate": b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "prompt": "\\udc00"}',
    "NaN": b'{"temperature": NaN, "messages": [{"role": "user", "content": "hi"}], "prompt": "x"}',
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def post_raw(client: httpx.Client, path: str, raw: bytes) -> httpx.Response:
    return client.post(path, content=raw, headers={"content-type": "application/json"})


# ---- hostile bodies: 400 in the route's envelope, on every JSON route ----

@pytest.mark.parametrize("name", list(HOSTILE_BODIES))
def test_issue16_hostile_json_is_400_in_each_routes_envelope(client: httpx.Client, name: str) -> None:
    for path in CHAT_ROUTES + ANTHROPIC_ROUTES:
        response = post_raw(client, path, HOSTILE_BODIES[name])
        assert response.status_code == 400, (path, name, response.text[:200])
        body = response.json()
        if path in ANTHROPIC_ROUTES:
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", path
        else:
            assert body["error"]["type"] == "invalid_request_error", path
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("path, field", [("/v1/chat/completions", "seed"), ("/completion", "seed"),
                                         ("/v1/responses", "seed")])
def test_issue16_seed_out_of_torch_range_is_400_and_the_engine_lives(client: httpx.Client, path: str,
                                                                      field: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi",
            "max_tokens": 4, "n_predict": 4, "max_output_tokens": 4, field: 18446744073709551616}
    response = client.post(path, json=body)
    assert response.status_code == 400 and "seed" in response.text
    assert client.post("/v1/chat/completions", json=chat_body(seed=2**64 - 1)).status_code == 200


def test_issue16_huge_max_tokens_is_clamped_to_the_context_and_logged(
        served: ServedModel, start_server: Callable[..., ServerThread], caplog: pytest.LogCaptureFixture) -> None:
    model = engine_like(served, EngineConfig(max_num_seqs=1, ctx_size=96))
    try:
        server = start_server(model, ServerConfig(port=0))
        with caplog.at_level(logging.INFO, logger="mlxcel.engine.loop"):
            body = httpx.post(server.address + "/v1/chat/completions", timeout=120,
                              json=chat_body(max_tokens=10**18, ignore_eos=True)).json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] <= 96
        assert any("clamped to" in r.getMessage() for r in caplog.records)
        native = httpx.post(server.address + "/completion", timeout=120,
                            json={"prompt": "Once", "n_predict": 10**18, "ignore_eos": True}).json()
        assert native["stop_type"] == "limit" and native["tokens_evaluated"] + native["tokens_predicted"] <= 96
    finally:
        model.close(30)


# ---- the engine survives one failing request; a dead engine is reported and ends the process ----

@pytest.fixture()
def faulty_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling raises for any row seeded 4242 (an injected fault inside the engine thread)."""
    real = engine_loop.sample

    def sample(logits, rows, counts=None):  # noqa: ANN001, ANN202 - same signature as the real one
        if any(row.params.seed == 4242 for row in rows):
            raise RuntimeError("injected sampling fault")
        return real(logits, rows, counts)

    monkeypatch.setattr(engine_loop, "sample", sample)


@pytest.mark.usefixtures("faulty_sampler")
def test_issue16_a_failing_request_gets_500_and_the_others_finish(client: httpx.Client, server: ServerThread) -> None:
    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.address, timeout=120) as http:
            bad = http.post("/v1/chat/completions", json=chat_body(seed=4242, temperature=1.0, max_tokens=8))
            good = [http.post("/v1/chat/completions", json=chat_body(max_tokens=8)) for _ in range(2)]
            return await asyncio.gather(bad, *good)

    bad, *good = asyncio.run(main())
    assert bad.status_code == 500 and bad.json()["error"]["type"] == "server_error"
    assert "internal" in bad.json()["error"]["message"]
    assert all(r.status_code == 200 and r.json()["choices"][0]["message"]["content"] for r in good)
    with client.stream("POST", "/v1/chat/completions",
                       json=chat_body(seed=4242, temperature=1.0, stream=True)) as stream:
        text = "".join(stream.iter_text())
    assert '"error"' in text and "internal" in text
    assert client.get("/health").json()["status"] == "ok"


def test_issue16_a_dead_engine_turns_health_503_and_serve_exits_1(served: ServedModel) -> None:
    model = engine_like(served, EngineConfig(max_num_seqs=1, ctx_size=256))
    state = ServerState(ServerConfig(port=0), model)
    sock = bind_socket(state.config)
    address = "http://%s:%d" % sock.getsockname()[:2]
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(serve(state, sock, [])), daemon=True)
    thread.start()
    wait_until(lambda: _is_up(address), what="the server")
    assert httpx.get(address + "/health").status_code == 200

    def die() -> None:
        raise SystemExit("injected: the loop itself breaks")

    model.engine.core.scheduler.schedule = die  # type: ignore[method-assign]
    response = httpx.post(address + "/v1/chat/completions", json=chat_body(), timeout=60)
    assert response.status_code in (500, 503) and "error" in response.json()
    thread.join(30)
    assert codes == [1] and not model.engine.core.is_alive
    assert model.engine.stats().is_alive is False
    model.close(10)


def _is_up(address: str) -> bool:
    try:
        return httpx.get(address + "/health", timeout=2).status_code in (200, 503)
    except httpx.HTTPError:
        return False


def test_issue16_health_is_503_while_the_engine_is_dead(served: ServedModel,
                                                        start_server: Callable[..., ServerThread]) -> None:
    model = engine_like(served, EngineConfig(max_num_seqs=1, ctx_size=256))
    server = start_server(model, ServerConfig(port=0))
    model.engine.core.scheduler.schedule = lambda: (_ for _ in ()).throw(SystemExit("injected"))  # type: ignore
    httpx.post(server.address + "/v1/chat/completions", json=chat_body(), timeout=60)
    wait_until(lambda: not model.engine.core.is_alive)
    health = httpx.get(server.address + "/health")
    assert health.status_code == 503 and health.json()["status"].startswith("error")
    model.close(10)


# ---- admission ----

def test_issue16_parallel_1_queue_2_always_admits_three(served: ServedModel,
                                                        start_server: Callable[..., ServerThread]) -> None:
    model = engine_like(served, EngineConfig(max_num_seqs=1, max_queue_depth=2, ctx_size=512))
    try:
        server = start_server(model, ServerConfig(port=0))

        async def burst(http: httpx.AsyncClient) -> list[int]:
            calls = [http.post("/v1/chat/completions", json=chat_body(max_tokens=2)) for _ in range(3)]
            return [r.status_code for r in await asyncio.gather(*calls)]

        async def main() -> list[list[int]]:
            async with httpx.AsyncClient(base_url=server.address, timeout=120) as http:
                return [await burst(http) for _ in range(8)]

        assert asyncio.run(main()) == [[200, 200, 200]] * 8
    finally:
        model.close(30)


def test_issue16_a_call_that_can_never_be_admitted_is_400_naming_the_limit(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json={"prompt": ["hi"] * 1000, "max_tokens": 1})
    assert response.status_code == 400
    assert "1000" in response.json()["error"]["message"] and "--max-queue-depth" in response.json()["error"]["message"]
    many_n = client.post("/completion", json={"prompt": ["a"] * 500, "n_predict": 1})
    assert many_n.status_code == 400


# ---- invalid roles, tool schemas, grammars: 400 before generation on every protocol ----

BAD_TOOLS = {"objekt": {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}},
             "empty function": {"type": "function", "function": {}},
             "parameters a string": {"type": "function", "function": {"name": "f", "parameters": "x"}}}


def test_issue16_unknown_roles_are_400(client: httpx.Client) -> None:
    alien = [{"role": "alien", "content": "hi"}]
    for path in ("/v1/chat/completions", "/apply-template", "/v1/chat/completions/input_tokens"):
        response = client.post(path, json={"messages": alien, "max_tokens": 2})
        assert response.status_code == 400 and "role" in response.json()["error"]["message"], path
    anth = client.post("/v1/messages", json={"model": "claude-test", "max_tokens": 2, "messages": alien})
    assert anth.status_code == 400 and anth.json()["type"] == "error"
    resp = client.post("/v1/responses", json={"input": [{"type": "message", "role": "alien", "content": "x"}]})
    assert resp.status_code == 400


@pytest.mark.parametrize("name", list(BAD_TOOLS))
def test_issue16_invalid_tool_schemas_are_400_on_every_protocol(client: httpx.Client, name: str) -> None:
    tool = BAD_TOOLS[name]
    chat = client.post("/v1/chat/completions", json=chat_body(tools=[tool]))
    assert chat.status_code == 400 and chat.json()["error"]["type"] == "invalid_request_error", chat.text
    function = tool["function"]
    anth_tool = {"name": function.get("name", ""), "input_schema": function.get("parameters", {})}
    anth = client.post("/v1/messages", json={"model": "claude-test", "max_tokens": 2, "tools": [anth_tool],
                                             "messages": [{"role": "user", "content": "hi"}]})
    assert anth.status_code == 400 and anth.json()["type"] == "error", anth.text
    resp_tool = {"type": "function", **function}
    resp = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "tools": [resp_tool]})
    assert resp.status_code == 400, resp.text


@pytest.mark.parametrize("constraint", [
    {"grammar": 'root ::= "a"{1000000}'},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "#"}}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}},
])
def test_issue16_grammars_llguidance_gives_up_on_are_400_before_generation(client: httpx.Client,
                                                                            constraint: dict) -> None:
    chat = client.post("/v1/chat/completions", json=chat_body(**constraint))
    assert chat.status_code == 400 and chat.json()["error"]["type"] == "invalid_request_error", chat.text
    native = client.post("/completion", json={"prompt": "x", "n_predict": 4, **constraint})
    assert native.status_code == 400, native.text


# ---- /openapi.json, /metrics ----

def test_issue16_openapi_schema_describes_the_public_routes_with_bodies(client: httpx.Client) -> None:
    schema = client.get("/openapi.json").json()
    assert schema["openapi"].startswith("3.1")
    chat = schema["paths"]["/v1/chat/completions"]["post"]
    ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    components = schema["components"]["schemas"]
    assert ref.rsplit("/", 1)[-1] in components
    assert {"messages", "max_tokens", "seed", "tools"} <= set(components["ChatCompletionRequest"]["properties"])
    assert "/v1/messages" in schema["paths"] and "/completion" in schema["paths"] and "/health" in schema["paths"]
    assert "/v1/images/generations" not in schema["paths"]  # spec J: only a process with --image-model has them
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(schema)))
    assert refs <= set(components)


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_issue16_aborted_sequences_are_counted(served: ServedModel, start_server: Callable[..., ServerThread]) -> None:
    model = engine_like(served, EngineConfig(max_num_seqs=2, ctx_size=1024))
    try:
        server = start_server(model, ServerConfig(port=0, endpoint_metrics=True))
        with httpx.Client(base_url=server.address, timeout=120) as http:
            http.post("/v1/chat/completions", json=chat_body())
            with http.stream("POST", "/v1/chat/completions",
                             json=chat_body(stream=True, max_tokens=400, ignore_eos=True)) as stream:
                lines = stream.iter_lines()
                next(line for line in lines if '"content":"' in line and '"content":""' not in line)
            wait_until(lambda: model.engine.stats().active_sequences == 0)
            text = http.get("/metrics").text
            started = metric(text, "mlxcel_sequences_started_total")
            completed = metric(text, "mlxcel_sequences_completed_total")
            aborted = metric(text, "mlxcel_sequences_aborted_total")
            assert aborted >= 1 and started == completed + aborted
            observed = http.get("/health").json()["observability"]
            assert observed["sequences_aborted"] == aborted
    finally:
        model.close(30)


# ---- the agent loop on a template without tool support (issue 17's bug, fixed in 16) ----

@pytest.fixture()
def sdk(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.address + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def test_issue16_openai_agent_loop_call_result_answer(sdk: openai.OpenAI) -> None:
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = sdk.chat.completions.create(model="m", messages=question, tools=[WEATHER_TOOL], tool_choice="required",
                                        temperature=0, max_tokens=40)
    (call,) = first.choices[0].message.tool_calls[:1]
    assert call.function.name == "get_weather" and first.choices[0].finish_reason == "tool_calls"
    loop = [*question,
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": call.id, "type": "function",
                             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    answer = sdk.chat.completions.create(model="m", messages=loop, tools=[WEATHER_TOOL], temperature=0, max_tokens=12)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The template knows no tools: the call and its result reach the prompt in the generic JSON form.
    prompt = httpx.post(str(sdk.base_url).replace("/v1/", "/apply-template"), json={"messages": loop}).json()["prompt"]
    assert '"tool_calls"' in prompt and '"get_weather"' in prompt and "Sunny, 21 C" in prompt
    streamed = sdk.chat.completions.create(model="m", messages=loop, temperature=0, max_tokens=6, stream=True)
    assert any(chunk.choices and chunk.choices[0].delta.content for chunk in streamed)


def test_issue16_anthropic_agent_loop_call_result_answer(server: ServerThread) -> None:
    client = anthropic.Anthropic(base_url=server.address, api_key="unused", max_retries=0, timeout=120)
    tool = {"name": "get_weather", "description": "The weather in a city",
            "input_schema": WEATHER_TOOL["function"]["parameters"]}
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model="claude-test", max_tokens=80, messages=question, tools=[tool],
                                   tool_choice={"type": "any"}, extra_body={"temperature": 0})  # the default is 1.0
    use = next(block for block in first.content if block.type == "tool_use")
    assert first.stop_reason == "tool_use" and use.name == "get_weather"
    loop = [*question, {"role": "assistant", "content": [block.model_dump() for block in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]}]
    answer = client.messages.create(model="claude-test", max_tokens=12, messages=loop, tools=[tool],
                                    extra_body={"temperature": 0})
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_issue16_responses_agent_loop_call_result_answer(sdk: openai.OpenAI) -> None:
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    first = sdk.responses.create(model="m", input="What is the weather in Paris?", tools=[tool],
                                 tool_choice="required", temperature=0, max_output_tokens=40, store=False)
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "get_weather"
    loop = [{"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    answer = sdk.responses.create(model="m", input=loop, tools=[tool], temperature=0, max_output_tokens=12,
                                  store=False)
    assert answer.status in ("completed", "incomplete") and answer.output


# ---- gaps the llama.cpp server tests found ----

def test_issue16_post_sampling_probs_are_probabilities_after_the_chain(client: httpx.Client) -> None:
    body = client.post("/completion", json={"prompt": "Today was the day. Today I would finally become a",
                                            "n_probs": 10, "temperature": 1.0, "n_predict": 5, "seed": 7,
                                            "post_sampling_probs": True}).json()
    probs = body["completion_probabilities"]
    assert len(probs) == 5
    for token in probs:
        assert 0.0 < token["prob"] <= 1.0 and "logprob" not in token and isinstance(token["bytes"], list)
        assert all(0.0 < p["prob"] <= 1.0 for p in token["top_probs"])
        if len(token["top_probs"]) < 10:  # fewer only when the chain kept fewer: they sum to 1
            assert sum(p["prob"] for p in token["top_probs"]) == pytest.approx(1.0, abs=1e-4)
    top_k_1 = client.post("/completion", json={"prompt": "Hi", "n_probs": 3, "top_k": 1, "n_predict": 2,
                                               "post_sampling_probs": True}).json()["completion_probabilities"]
    assert all(t["prob"] == pytest.approx(1.0) and len(t["top_probs"]) == 1 for t in top_k_1)


def test_issue16_metrics_carry_the_process_start_time(client: httpx.Client) -> None:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert abs(int(response.headers["Process-Start-Time-Unix"]) - __import__("time").time()) < 24 * 3600


def test_issue16_two_trailing_assistant_turns_are_400(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "test"}, {"role": "assistant", "content": "test"},
                {"role": "assistant", "content": "test"}]
    for path in ("/v1/chat/completions", "/apply-template"):
        response = client.post(path, json={"messages": messages, "max_tokens": 2})
        assert response.status_code == 400 and "assistant" in response.json()["error"]["message"], path
