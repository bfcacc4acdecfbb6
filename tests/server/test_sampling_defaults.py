"""Issue 13 (F9): the server's sampling defaults (--temp, --top-k, ...) through the real server. A request
that leaves a field out gets the server's value on every protocol, one that sends it keeps its own;
PATCH /v1/settings changes /props and the next request; a bad value is refused with the table's message."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace

import httpx
import openai
import pytest

from mlxcel.command_line import OPTIONS, resolve_values, serve_parser
from mlxcel.config import EngineConfig
from mlxcel.env import Environment
from mlxcel.serving.served_model import ServedModel
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread
from mlxcel.server.state import ServerState
from mlxcel.settings import BY_NAME

from .conftest import engine_like

PROMPT = "Once upon a time"
SEEDS = (1, 2, 3)


@pytest.fixture(scope="module")
def live(served: ServedModel) -> Iterator[tuple[httpx.Client, ServerState]]:
    values = resolve_values(serve_parser("x", "serve").parse_args(["--temp", "0", "-np", "2"]), OPTIONS,
                            Environment.read({}))
    model = engine_like(served, EngineConfig(max_num_seqs=2, ctx_size=1024, max_queue_depth=64))
    state = ServerState(ServerConfig(port=0, endpoint_props=True), model, settings=values)
    thread = ServerThread(state).start()
    with httpx.Client(base_url=thread.address, timeout=120) as http:
        yield http, state
    thread.stop()
    model.close(30)
    logging.getLogger().setLevel(logging.WARNING)


def chat_texts(http: httpx.Client, **fields: object) -> list[str]:
    """The reply to one chat request per seed, `fields` added (no temperature unless given)."""
    texts = []
    for seed in SEEDS:
        body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12, "seed": seed,
                **fields}
        reply = http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        texts.append(reply.json()["choices"][0]["message"]["content"])
    return texts


def completion_replies(http: httpx.Client, **fields: object) -> list[dict[str, object]]:
    replies = []
    for seed in SEEDS:
        reply = http.post("/completion", json={"prompt": PROMPT, "n_predict": 12, "seed": seed, **fields})
        assert reply.status_code == 200, reply.text
        replies.append(reply.json())
    return replies


def props_params(http: httpx.Client) -> dict[str, object]:
    return http.get("/props").json()["default_generation_settings"]["params"]


def patch(http: httpx.Client, settings: dict[str, object], **fields: object) -> httpx.Response:
    return http.patch("/v1/settings", json={"settings": settings, **fields})


def test_temp_0_makes_chat_requests_without_temperature_greedy(live: tuple[httpx.Client, ServerState]) -> None:
    http, _ = live
    unsent = chat_texts(http)
    assert len(set(unsent)) == 1 and unsent == chat_texts(http, temperature=0)  # greedy whatever the seed
    assert len(set(chat_texts(http, temperature=1.5, top_p=1.0))) > 1  # a request's own temperature wins


def test_temp_0_makes_completion_requests_without_temperature_greedy(live: tuple[httpx.Client, ServerState]) -> None:
    http, _ = live
    unsent = completion_replies(http)
    assert len({r["content"] for r in unsent}) == 1
    assert unsent[0]["generation_settings"]["temperature"] == 0.0  # as applied: the server's --temp
    assert unsent[0]["content"] == completion_replies(http, temperature=0)[0]["content"]
    sent = completion_replies(http, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    assert sent[0]["generation_settings"]["temperature"] == 1.5 and len({r["content"] for r in sent}) > 1


def test_temp_0_reaches_messages_and_responses(live: tuple[httpx.Client, ServerState]) -> None:
    http, _ = live
    messages = [{"role": "user", "content": "Tell me a story."}]
    anthropic = set()  # Messages has no seed field: each request gets a fresh one, only --temp keeps it greedy
    for _ in SEEDS:
        reply = http.post("/v1/messages", json={"model": "claude-sonnet-5-5", "max_tokens": 12, "messages": messages})
        assert reply.status_code == 200, reply.text
        anthropic.add(reply.json()["content"][0]["text"])
    responses = set()
    for seed in SEEDS:
        reply = http.post("/v1/responses", json={"model": "m", "max_output_tokens": 12, "seed": seed,
                                                 "input": "Tell me a story.", "store": False})
        assert reply.status_code == 200, reply.text
        responses.add(reply.json()["output"][-1]["content"][0]["text"])
    assert len(anthropic) == 1 and len(responses) == 1


def test_props_shows_the_effective_completion_defaults(live: tuple[httpx.Client, ServerState]) -> None:
    http, _ = live
    params = props_params(http)
    assert params["temperature"] == 0.0  # --temp 0
    assert (params["top_k"], params["top_p"], params["min_p"], params["repeat_last_n"]) == (40, 0.95, 0.05, 64)
    assert (params["repeat_penalty"], params["presence_penalty"], params["frequency_penalty"]) == (1.0, 0.0, 0.0)
    settings = http.get("/v1/settings").json()
    assert settings["settings"]["default_temperature"] == 0.0 and settings["settings"]["default_top_k"] is None
    assert settings["schema"]["default_top_k"]["flags"] == ["--top-k"]
    assert settings["schema"]["default_top_k"]["env"] == ["LLAMA_ARG_TOP_K"]
    assert settings["schema"]["default_temperature"]["env"] == ["LLAMA_ARG_TEMP"]
    # issue 46: each effective default and where it came from (SmolLM2's GGUF declares no sampling keys)
    sources = http.get("/props").json()["default_generation_settings"]["sampling_sources"]
    assert sources == settings["sampling_defaults"]
    assert sources["temperature"] == {"value": 0.0, "source": "server"}
    assert sources["top_k"] == {"value": 40, "source": "llama-server"}
    assert sources["min_p"] == {"value": 0.05, "source": "llama-server"}


def test_patch_top_k_and_temp_change_props_and_the_next_request(live: tuple[httpx.Client, ServerState]) -> None:
    http, state = live
    reply = patch(http, {"default_top_k": 1, "default_temperature": 1.5})
    assert reply.status_code == 200 and reply.json()["applied"] == {"default_top_k": 1, "default_temperature": 1.5}
    assert state.api is not None and (state.api.sampling.top_k, state.api.sampling.temperature) == (1, 1.5)
    params = props_params(http)
    assert (params["top_k"], params["temperature"]) == (1, 1.5)
    replies = completion_replies(http)
    assert len({r["content"] for r in replies}) == 1  # top-k 1 is greedy whatever the temperature
    assert (replies[0]["generation_settings"]["top_k"], replies[0]["generation_settings"]["temperature"]) == (1, 1.5)
    assert len(set(chat_texts(http))) == 1  # OpenAI requests get the server's top_k too

    assert patch(http, {"default_top_k": None}).json()["applied"] == {"default_top_k": None}  # unset again
    assert props_params(http)["top_k"] == 40  # llama-server's own default is back
    assert len(set(chat_texts(http, top_p=1.0))) > 1  # temperature 1.5 now samples
    body = patch(http, {}, replace=True).json()  # back to the startup values: --temp 0
    assert body["settings"]["default_temperature"] == 0.0 and props_params(http)["temperature"] == 0.0
    assert len(set(chat_texts(http))) == 1


@pytest.mark.parametrize(("name", "value"), [("default_temperature", -1), ("default_top_p", 2),
                                             ("default_min_p", "lots"), ("default_repeat_penalty", 0),
                                             ("default_repeat_last_n", -2), ("default_top_k", 1.5)])
def test_a_bad_patch_value_is_a_400_naming_the_setting(live: tuple[httpx.Client, ServerState], name: str,
                                                         value: object) -> None:
    http, state = live
    before = props_params(http)
    reply = patch(http, {name: value})
    assert reply.status_code == 400
    (rejected,) = reply.json()["error"]["rejected"]
    flag_error = pytest.raises(ValueError, BY_NAME[name].parse, str(value)).value
    assert rejected["name"] == name and rejected["code"] == "invalid_value" and rejected["message"] == str(flag_error)
    assert rejected["message"].startswith(f"{name} (--") and props_params(http) == before


def test_issue25_f4_f1_typical_p_and_xtc_reach_the_sampler_on_both_protocols(live: tuple[httpx.Client, ServerState]) -> None:
    """llama-server's typical_p and XTC fields, sent to /completion and /v1/chat/completions. XTC on every step with
    threshold 0 removes all of the chain's survivors but the least likely: each token is then certain, whatever
    the seed, and not the greedy one."""
    http, _ = live
    xtc = {"xtc_probability": 1.0, "xtc_threshold": 0.0}
    replies = completion_replies(http, temperature=1.0, n_probs=1, post_sampling_probs=True, **xtc)
    greedy = completion_replies(http, temperature=0.0)
    assert len({r["content"] for r in replies}) == 1 and replies[0]["content"] != greedy[0]["content"]
    assert all(p["top_probs"][0]["prob"] == 1.0 for r in replies for p in r["completion_probabilities"])
    assert {k: replies[0]["generation_settings"][k] for k in xtc} == xtc
    typical = completion_replies(http, temperature=1.0, typical_p=0.3)
    assert typical[0]["generation_settings"]["typical_p"] == 0.3
    chats = chat_texts(http, temperature=1.0, **xtc)
    assert len(set(chats)) == 1 and chats[0] != chat_texts(http, temperature=0.0)[0]
    shown = props_params(http)  # what llama-server's web UI reads as the defaults: each of them off
    assert {k: shown[k] for k in ("typical_p", "xtc_probability", "top_n_sigma", "mirostat", "dry_multiplier")} == {
        "typical_p": 1.0, "xtc_probability": 0.0, "top_n_sigma": -1.0, "mirostat": 0, "dry_multiplier": 0.0}
    bad = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "typical_p": 1.5})
    assert bad.status_code == 400 and "typical_p" in bad.json()["error"]["message"]


def test_issue25_f4_f1_mirostat_reaches_the_sampler_on_both_protocols(live: tuple[httpx.Client, ServerState]) -> None:
    """Mirostat 2 with tau 0 and eta 0 keeps mu at 0: only the best token passes, so a temperature-1 request with
    any seed replies what greedy does, on /completion (whose top-k 40 mirostat replaces) and the OpenAI routes."""
    http, _ = live
    pinned = {"mirostat": 2, "mirostat_tau": 0.0, "mirostat_eta": 0.0}
    greedy = completion_replies(http, temperature=0.0)[0]["content"]
    replies = completion_replies(http, temperature=1.0, **pinned)
    assert [r["content"] for r in replies] == [greedy] * len(SEEDS)
    assert {k: replies[0]["generation_settings"][k] for k in pinned} == pinned
    assert chat_texts(http, temperature=1.0, **pinned) == [chat_texts(http, temperature=0.0)[0]] * len(SEEDS)
    with openai.OpenAI(base_url=str(http.base_url.join("/v1")), api_key="unused", max_retries=0, timeout=120) as sdk:
        sent = [sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "Tell me a story."}],
                                            max_tokens=12, seed=seed, temperature=1.0, extra_body=pinned)
                for seed in SEEDS]  # as the OpenAI SDK sends llama-server's fields
    assert [r.choices[0].message.content for r in sent] == [chat_texts(http, temperature=0.0)[0]] * len(SEEDS)
    steered = completion_replies(http, temperature=1.0, mirostat=1, mirostat_tau=5.0)
    assert len({r["content"] for r in steered}) > 1  # it samples


def test_issue25_f4_f1_dry_reaches_the_sampler_on_both_protocols(live: tuple[httpx.Client, ServerState]) -> None:
    """Greedy continues "1 2 3 1 2 3 1 2 3 1 2" with " 3"; DRY penalizes the token that extends the repeat, unless a
    breaker (" 2") ends every repeat just before it. An empty breaker list is a 400, as in llama-server."""
    http, _ = live
    body = {"prompt": "1 2 3 1 2 3 1 2 3 1 2", "n_predict": 2, "temperature": 0.0}
    plain = http.post("/completion", json=body).json()["content"]
    dry = http.post("/completion", json={**body, "dry_multiplier": 5.0}).json()
    broken = http.post("/completion", json={**body, "dry_multiplier": 5.0, "dry_sequence_breakers": [" 2"]}).json()
    assert plain.startswith(" 3") and not dry["content"].startswith(" 3") and broken["content"].startswith(" 3")
    assert dry["generation_settings"]["dry_sequence_breakers"] == ["\n", ":", '"', "*"]
    chat = http.post("/v1/completions", json={"prompt": body["prompt"], "max_tokens": 2, "temperature": 0.0,
                                              "dry_multiplier": 5.0}).json()
    assert chat["choices"][0]["text"] == dry["content"]
    empty = http.post("/completion", json={**body, "dry_sequence_breakers": []})
    assert empty.status_code == 400 and "dry_sequence_breakers" in empty.json()["error"]["message"]


def test_issue46_checkpoint_defaults_sit_between_the_server_flags_and_llama_servers(
        live: tuple[httpx.Client, ServerState]) -> None:
    """What attach builds for a checkpoint declaring top_k 1 (generation_config.json or GGUF general.sampling.top_k):
    requests leaving top_k out are greedy on every protocol; a --top-k (PATCH) still wins over it; /props says so."""
    http, state = live
    assert state.api is not None
    before = state.api.sampling
    patch(http, {"default_temperature": 1.5})
    state.api = replace(state.api, sampling=replace(state.api.sampling, checkpoint={"top_k": 1}))
    try:
        assert http.get("/props").json()["default_generation_settings"]["sampling_sources"]["top_k"] == {
            "value": 1, "source": "checkpoint"}
        assert len(set(chat_texts(http))) == 1 and len({r["content"] for r in completion_replies(http)}) == 1
        messages = {http.post("/v1/messages", json={"model": "c", "max_tokens": 12, "messages": [
            {"role": "user", "content": "Tell me a story."}]}).json()["content"][0]["text"] for _ in SEEDS}
        assert len(messages) == 1
        assert len(set(chat_texts(http, top_k=0, top_p=1.0))) > 1  # the request's own top_k wins: it samples
        patch(http, {"default_top_k": 0})  # a server flag wins over the checkpoint: temperature 1.5 samples
        assert http.get("/props").json()["default_generation_settings"]["sampling_sources"]["top_k"] == {
            "value": 0, "source": "server"}
        assert len(set(chat_texts(http, top_p=1.0))) > 1
    finally:
        patch(http, {}, replace=True)
        state.api = replace(state.api, sampling=before)
