"""F9 /v1/settings through the real server: typed schema and values from the settings table, a
fingerprint that changes exactly when a mutable value does, PATCH that applies valid names even
when others are rejected, replace mode, effect on the next request, and the API key."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import httpx
import pytest

from mlxcel.command_line import OPTIONS, resolve_values, serve_parser
from mlxcel.config import EngineConfig
from mlxcel.env import Environment
from mlxcel.serving.served_model import ServedModel
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread
from mlxcel.server.state import ServerState
from mlxcel.settings import BY_NAME, SETTINGS

from .conftest import chat_body, engine_like

KEY = "settings-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def live(served: ServedModel) -> Iterator[tuple[httpx.Client, ServerState]]:
    values = resolve_values(serve_parser("x", "serve").parse_args(["-np", "1", "--reasoning-budget", "-1"]), OPTIONS,
                            Environment.read({"LLAMA_API_KEY": KEY}))
    model = engine_like(served, EngineConfig(max_num_seqs=1, ctx_size=1024, max_queue_depth=64))
    state = ServerState(ServerConfig(port=0, api_keys=(KEY,), endpoint_props=True), model, settings=values)
    thread = ServerThread(state).start()
    with httpx.Client(base_url=thread.address, timeout=120, headers=AUTH) as http:
        yield http, state
    thread.stop()
    logging.getLogger().setLevel(logging.WARNING)


def patch(http: httpx.Client, settings: dict[str, object], **fields: object) -> httpx.Response:
    return http.patch("/v1/settings", json={"settings": settings, **fields})


def test_f9_get_lists_every_setting_typed_with_its_value(live: tuple[httpx.Client, ServerState]) -> None:
    http, _ = live
    body = http.get("/v1/settings").json()
    assert set(body["schema"]) == set(body["settings"]) == {s.name for s in SETTINGS}
    assert body["schema"]["max_queue_depth"] | {"description": ""} == {
        "type": "integer", "accepted": "a whole number >= 0", "default": 64, "nullable": False, "mutable": True,
        "flags": ["--max-queue-depth"], "env": ["LLAMA_ARG_MAX_QUEUE_DEPTH"], "description": ""}
    assert body["schema"]["cache_type_k"]["enum"] == ["f32", "bf16", "f16", "q8_0"]
    assert body["settings"]["parallel"] == 1 and body["settings"]["api_key"] is None  # secrets never shown
    assert body["fingerprint"].startswith("sha256:") and http.get("/settings").json() == body


def test_f9_patch_applies_valid_names_and_reports_rejected_ones(live: tuple[httpx.Client, ServerState]) -> None:
    http, state = live
    before = http.get("/v1/settings").json()["fingerprint"]
    reply = patch(http, {"reasoning_budget": 32, "max_queue_depth": "lots", "port": 1, "no_such": 1})
    assert reply.status_code == 200
    body = reply.json()
    assert body["applied"] == {"reasoning_budget": 32} and body["settings"]["reasoning_budget"] == 32
    codes = {r["name"]: r["code"] for r in body["rejected"]}
    assert codes == {"max_queue_depth": "invalid_value", "port": "read_only_setting", "no_such": "unknown_setting"}
    flag_message = str(pytest.raises(ValueError, BY_NAME["max_queue_depth"].parse, "lots").value)
    assert next(r["message"] for r in body["rejected"] if r["name"] == "max_queue_depth") == flag_message
    assert body["fingerprint"] != before and state.api is not None and state.api.features.reasoning_budget == 32
    assert patch(http, {"reasoning_budget": -1}).json()["fingerprint"] == before  # stable: same values, same hash


def test_f9_fingerprint_ignores_read_only_and_unchanged_values(live: tuple[httpx.Client, ServerState]) -> None:
    http, _ = live
    current = http.get("/v1/settings").json()
    round_trip = patch(http, current["settings"])  # GET's own values back (the key as null): nothing changes
    assert round_trip.status_code == 200 and round_trip.json()["applied"] == {} and not round_trip.json()["rejected"]
    assert round_trip.json()["fingerprint"] == current["fingerprint"]


def test_f9_everything_rejected_is_a_400_listing_each(live: tuple[httpx.Client, ServerState]) -> None:
    http, _ = live
    reply = patch(http, {"decode_timeout": -5, "ctx_size": 9})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["applied"] == {} and {r["name"] for r in error["rejected"]} == {"decode_timeout", "ctx_size"}
    assert patch(http, {}, replace="yes").status_code == 400 and http.patch("/v1/settings", json=[1]).status_code == 400


def test_f9_replace_resets_unnamed_mutable_settings(live: tuple[httpx.Client, ServerState]) -> None:
    http, state = live
    assert patch(http, {"reasoning_budget": 7, "loop_detection": "off"}).status_code == 200
    body = patch(http, {"verbose": True}, replace=True).json()
    assert body["settings"]["reasoning_budget"] == -1 and body["settings"]["loop_detection"] is None
    assert body["settings"]["verbose"] is True and logging.getLogger().level == logging.DEBUG
    assert state.api is not None and state.api.features.loop_operator == {}
    patch(http, {}, replace=True)
    assert logging.getLogger().level == logging.INFO


def test_f9_queue_depth_takes_effect_on_the_next_request(live: tuple[httpx.Client, ServerState]) -> None:
    http, state = live
    assert patch(http, {"max_queue_depth": 0}).json()["applied"] == {"max_queue_depth": 0}
    assert state.served is not None and state.served.engine.core.config.max_queue_depth == 0
    with http.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=300, stream=True)) as first:
        assert first.status_code == 200
        next(first.iter_lines())  # the only slot is taken
        second = http.post("/v1/chat/completions", json=chat_body())
        assert second.status_code == 503 and "queue is full (0 waiting)" in second.json()["error"]["message"]
    assert patch(http, {"max_queue_depth": 64}).status_code == 200


def test_f9_sampling_defaults_take_effect_on_the_next_request(live: tuple[httpx.Client, ServerState]) -> None:
    """-n limits and -s seeds the requests that name no limit / no seed, changed at run time."""
    http, _ = live
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": None, "temperature": 1.0}  # null: no limit
    assert patch(http, {"default_n_predict": 3, "default_seed": 7}).json()["applied"] == {
        "default_n_predict": 3, "default_seed": 7}
    first, second = (http.post("/v1/completions", json=body).json() for _ in range(2))
    assert first["usage"]["completion_tokens"] == 3
    assert first["choices"][0]["text"] == second["choices"][0]["text"]  # the same seed: the same sample
    assert patch(http, {"default_n_predict": -1, "default_seed": -1}).status_code == 200
    assert http.post("/v1/completions", json={**body, "max_tokens": 5}).json()["usage"]["completion_tokens"] == 5


def test_f9_props_shows_the_live_settings(live: tuple[httpx.Client, ServerState]) -> None:
    """/props reports the settings table's current values: a PATCHed -n / -s shows there on the next GET."""
    http, _ = live

    def props() -> tuple[int, int, int]:
        body = http.get("/props").json()
        params = body["default_generation_settings"]["params"]
        return body["total_slots"], params["n_predict"], params["seed"]

    assert props() == (1, -1, 4294967295)  # -np 1; no limit; llama-server's "random"
    params = http.get("/props").json()["default_generation_settings"]["params"]
    assert (params["temperature"], params["top_k"], params["top_p"], params["min_p"]) == (0.8, 40, 0.95, 0.05)
    assert patch(http, {"default_n_predict": 12, "default_seed": 9}).status_code == 200
    assert props() == (1, 12, 9)
    settings = http.get("/v1/settings").json()["settings"]
    assert (settings["default_n_predict"], settings["default_seed"]) == (12, 9)
    assert patch(http, {}, replace=True).status_code == 200
    assert props() == (1, -1, 4294967295)


def test_f9_settings_need_the_api_key(live: tuple[httpx.Client, ServerState]) -> None:
    http, _ = live
    base = str(http.base_url)
    assert httpx.get(base + "/v1/settings").status_code == 401
    assert httpx.patch(base + "/settings", json={"settings": {"verbose": True}}).status_code == 401
    assert http.get("/v1/settings").json()["settings"]["verbose"] is False


def test_f9_openapi_lists_the_settings_routes(live: tuple[httpx.Client, ServerState]) -> None:
    http, _ = live
    paths = httpx.get(str(http.base_url) + "/openapi.json").json()["paths"]
    assert {"get", "patch"} <= set(paths["/v1/settings"]) and "requestBody" in paths["/v1/settings"]["patch"]


def test_f9_values_patched_before_a_model_loads_apply_when_it_attaches(served: ServedModel) -> None:
    state = ServerState(ServerConfig(port=0))
    thread = ServerThread(state).start()
    model = engine_like(served, EngineConfig(max_num_seqs=1, ctx_size=1024))
    try:
        reply = httpx.patch(thread.address + "/v1/settings", json={"settings": {
            "reasoning_budget": 5, "max_queue_depth": 3, "default_n_predict": 7}})
        assert reply.status_code == 200 and set(reply.json()["applied"]) == {
            "reasoning_budget", "max_queue_depth", "default_n_predict"}
        state.attach(model)  # as the web UI's load does
        assert state.api is not None and state.api.features.reasoning_budget == 5
        assert model.engine.core.config.max_queue_depth == 3
        assert model.engine.core.config.n_predict == 7 and state.live.current["default_n_predict"] == 7
    finally:
        thread.stop()
        model.close(30)
