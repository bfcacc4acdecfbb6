"""Issue 12 through the real server on SmolLM2: with prompt lookup on, every feature answers as it
does without it (temperature 0: the same text), and the draft counters and configuration show in
/metrics, /health and /props."""

from __future__ import annotations

import json
from dataclasses import replace
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import torch
import jsonschema
import pytest

from mlxcel.config import SpeculativeConfig
from mlxcel.serving.served_model import ServedModel
from mlxcel.server.lifecycle import ServerThread
from tests.server.conftest import ENGINE, chat_body, engine_like

pytestmark = pytest.mark.slow

CODE = "def add(a, b):\n    result = a + b\n    return result\n\nprint(add(2, 3))\n"
EDIT = f"Rewrite this code with the function renamed to plus. Code:\n{CODE}"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
LOOKUP = SpeculativeConfig(draft_kind="prompt-lookup", draft_max=8, max_batch=4)


@pytest.fixture(scope="module")
def spec_server(served: ServedModel, start_server: Callable[..., ServerThread]) -> Iterator[ServerThread]:
    config = replace(ENGINE, speculative=LOOKUP)  # the plain server's step too: logprobs compare bit for bit
    model = engine_like(served, config)
    yield start_server(model)
    model.close(30)


@pytest.fixture()
def spec(spec_server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=spec_server.address, timeout=180) as http:
        yield http


def both(client: httpx.Client, spec: httpx.Client, path: str, body: dict[str, Any]) -> tuple[dict, dict]:
    plain, fast = client.post(path, json=body), spec.post(path, json=body)
    assert plain.status_code == 200 and fast.status_code == 200, (plain.text, fast.text)
    return plain.json(), fast.json()


def content(reply: dict) -> list[str | None]:
    return [choice["message"]["content"] for choice in reply["choices"]]


def test_grounded_edit_with_stop_strings_is_unchanged_and_drafts_are_counted(client, spec) -> None:  # noqa: ANN001
    before = spec.get("/health").json()["speculative"]
    body = chat_body(EDIT, max_tokens=64, stop=["print("])
    plain, fast = both(client, spec, "/v1/chat/completions", body)
    assert content(fast) == content(plain) and fast["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert fast["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    after = spec.get("/health").json()["speculative"]
    assert after["draft_kind"] == "prompt-lookup" and after["draft_max"] == 8 and after["max_batch"] == 4
    assert after["drafted_tokens"] > before["drafted_tokens"] and after["accepted_tokens"] > before["accepted_tokens"]


def test_json_schema_output_is_unchanged_and_valid(client, spec) -> None:  # noqa: ANN001
    body = chat_body("Give me a person as JSON.", max_tokens=60,
                     response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    plain, fast = both(client, spec, "/v1/chat/completions", body)
    assert content(fast) == content(plain)
    jsonschema.validate(json.loads(content(fast)[0]), PERSON)


def test_logprobs_n_and_seeded_sampling_are_unchanged(client, spec) -> None:  # noqa: ANN001
    # cache_prompt false: the plain server may hold this prompt from an earlier test, and a cache
    # hit's split prefill may differ in the last bits (spec M), which logprobs show.
    body = chat_body(EDIT, max_tokens=24, logprobs=True, top_logprobs=2, cache_prompt=False)
    plain, fast = both(client, spec, "/v1/chat/completions", body)
    assert fast["choices"][0]["logprobs"] == plain["choices"][0]["logprobs"]  # the target's own logprobs
    body = chat_body(EDIT, max_tokens=24, n=2, temperature=0.8, seed=5, cache_prompt=False)
    plain, fast = both(client, spec, "/v1/chat/completions", body)
    assert content(fast) == content(plain)


def test_concurrent_requests_and_a_prefix_cache_hit_are_unchanged(client, spec) -> None:  # noqa: ANN001
    bodies = [chat_body(EDIT, max_tokens=40), chat_body("Count from one to ten in words.", max_tokens=40),
              chat_body(f"Quote the last line of this code exactly:\n{CODE}", max_tokens=20)]
    with ThreadPoolExecutor(3) as pool:
        plain = list(pool.map(lambda b: client.post("/v1/chat/completions", json=b).json(), bodies))
        fast = list(pool.map(lambda b: spec.post("/v1/chat/completions", json=b).json(), bodies))
    assert [content(r) for r in fast] == [content(r) for r in plain]
    again = spec.post("/v1/chat/completions", json=bodies[0]).json()
    assert content(again) == content(plain[0]) and again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_metrics_props_and_slots_show_speculation(spec) -> None:  # noqa: ANN001
    spec.post("/v1/chat/completions", json=chat_body(EDIT, max_tokens=16))
    metrics = spec.get("/metrics").text
    drafted = next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("mlxcel_draft_tokens_total"))
    accepted = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("mlxcel_draft_tokens_accepted_total"))
    rate = next(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("mlxcel_draft_acceptance_rate"))
    assert drafted > 0 and 0 < accepted <= drafted and rate == pytest.approx(accepted / drafted, rel=1e-6)
    props = spec.get("/props").json()["speculative"]
    assert props["draft_kind"] == "prompt-lookup" and props["draft_model"] is None
    assert spec.get("/slots").status_code == 200


def test_without_speculation_health_has_no_draft_fields(client) -> None:  # noqa: ANN001
    assert "speculative" not in client.get("/health").json()


def test_forced_tool_call_is_unchanged(client, spec) -> None:  # noqa: ANN001
    from tests.server.test_structured_output import WEATHER_TOOL

    body = chat_body("What is the weather in Paris?", max_tokens=60, tools=[WEATHER_TOOL], tool_choice="required")
    plain, fast = both(client, spec, "/v1/chat/completions", body)
    calls = fast["choices"][0]["message"]["tool_calls"]
    assert calls and [c["function"] for c in calls] == [c["function"] for c in plain["choices"][0]["message"]["tool_calls"]]
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), WEATHER_TOOL["function"]["parameters"])


@pytest.fixture(scope="module")
def drafting_server(served: ServedModel, start_server: Callable[..., ServerThread]) -> Iterator[ServerThread]:
    """SmolLM2 drafting for itself (B1): the same weights, the drafter's own paged KV."""
    from mlxcel.engine.client import EngineClient
    from mlxcel.engine.loop import EngineCore
    from mlxcel.engine.spec import DraftPolicy
    from mlxcel.engine.spec.draft_model import ModelDrafter
    from mlxcel.serving.served_model import model_shape

    spec = SpeculativeConfig(draft_kind="full-model", draft_model="SmolLM2 (itself)", draft_max=4)
    config = replace(ENGINE, speculative=spec)  # the plain server's decode step too
    shape = model_shape(served.loaded)
    drafter = ModelDrafter(served.loaded.model, shape, num_blocks=config.num_blocks(shape.context_length, 1),
                           block_size=config.block_size, device="cpu", dtype=torch.float32, mode="eager",
                           max_rows=config.max_num_seqs)
    core = EngineCore(served.loaded.model, shape, config, eos_token_ids=served.tokenizer.eos_token_ids,
                      drafts=DraftPolicy(spec, drafter))
    core.start()
    model = ServedModel(served.name, served.loaded, served.tokenizer, served.chat_template, EngineClient(core), config,
                        served.features)
    yield start_server(model)
    model.close(30)


def test_full_model_drafting_keeps_stop_strings_and_json_schema_output(client, drafting_server) -> None:  # noqa: ANN001
    with httpx.Client(base_url=drafting_server.address, timeout=180) as drafting:
        # cache_prompt false: a cache hit's split prefill may part a near-tie (spec M); this compares drafting
        plain, fast = both(client, drafting, "/v1/chat/completions",
                           chat_body(EDIT, max_tokens=48, stop=["print("], cache_prompt=False))
        assert content(fast) == content(plain)
        # cached_tokens may differ: the plain server has seen this prompt in earlier tests
        assert [fast["usage"][k] for k in ("prompt_tokens", "completion_tokens")] == \
            [plain["usage"][k] for k in ("prompt_tokens", "completion_tokens")]
        body = chat_body("Give me a person as JSON.", max_tokens=60, cache_prompt=False,
                         response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
        plain, fast = both(client, drafting, "/v1/chat/completions", body)
        assert content(fast) == content(plain)
        jsonschema.validate(json.loads(content(fast)[0]), PERSON)
        drafts = drafting.get("/health").json()["speculative"]
    assert drafts["draft_kind"] == "full-model" and drafts["accepted_tokens"] > 0
