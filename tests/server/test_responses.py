"""OpenAI Responses API (F2, F5, D1) on the real default model, driven by the official `openai` SDK
(`client.responses`) and httpx. Temperature 0 and a handful of tokens, so outputs are deterministic.
"""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from mlxcel.serving.served_model import ServedModel
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread
from mlxcel.server.state import ServerState

pytestmark = pytest.mark.slow
HI = {"model": "m", "temperature": 0}


@pytest.fixture()
def sdk(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.address + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture()
def greeting(sdk: openai.OpenAI) -> str:
    """SmolLM2's greedy chat answer to "Hi" on this server, which every Responses reply must equal."""
    text = sdk.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], max_tokens=32, **HI)
    content = text.choices[0].message.content
    assert content.startswith("Hello!"), content
    return content


def wait_for_status(sdk: openai.OpenAI, response_id: str, timeout: float = 60.0) -> openai.types.responses.Response:
    end = time.monotonic() + timeout
    while True:
        response = sdk.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress") or time.monotonic() > end:
            return response
        time.sleep(0.05)


# ---- create ----

def test_f2_create_string_input_matches_chat(sdk: openai.OpenAI, greeting: str) -> None:
    response = sdk.responses.create(input="Hi", max_output_tokens=32, **HI)
    chat = sdk.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], max_tokens=32, **HI)
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    assert response.model == "SmolLM2-135M-Instruct" and response.store is True
    message = response.output[0]
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert response.output_text == chat.choices[0].message.content == greeting
    usage = response.usage
    assert usage.input_tokens == chat.usage.prompt_tokens and usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0 and response.incomplete_details is None


def test_f2_item_input_and_instructions(sdk: openai.OpenAI) -> None:
    # cache_prompt false: the second request would start from the first one's cached blocks, and a
    # cache hit's split prefill may differ in the last bits (spec M), enough to part a near-tie.
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]
    response = sdk.responses.create(input=items, instructions="Answer in French.", max_output_tokens=6,
                                    metadata={"case": "items"}, extra_body={"cache_prompt": False}, **HI)
    chat = sdk.chat.completions.create(messages=[{"role": "system", "content": "Answer in French."},
                                                 {"role": "user", "content": "Hi"}], max_tokens=6,
                                       extra_body={"cache_prompt": False}, **HI)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.instructions == "Answer in French." and response.metadata == {"case": "items"}
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


# ---- stream ----

def test_f2_stream_events_in_order_and_deltas_assemble(sdk: openai.OpenAI, greeting: str) -> None:
    events = list(sdk.responses.create(input="Hi", max_output_tokens=32, stream=True, **HI))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"} and len(types[4:-4]) > 3
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == greeting == events[-4].text == events[-1].response.output_text
    ids = {e.response.id for e in events if e.type.startswith("response.") and hasattr(e, "response")}
    assert len(ids) == 1 and events[2].item.id == events[-2].item.id


def test_f2_sdk_stream_helper_final_response(sdk: openai.OpenAI, greeting: str) -> None:
    with sdk.responses.stream(input="Hi", max_output_tokens=32, **HI) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == greeting and final.status == "completed"
    assert sdk.responses.retrieve(final.id).output_text == greeting  # stored once the stream ended


def test_f2_stream_cut_by_max_output_tokens_is_incomplete(sdk: openai.OpenAI) -> None:
    events = list(sdk.responses.create(input="Hi", max_output_tokens=3, stream=True, **HI))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 3


# ---- retrieve, delete, store ----

def test_f2_retrieve_delete_then_404(sdk: openai.OpenAI, client: httpx.Client) -> None:
    created = sdk.responses.create(input="Hi", max_output_tokens=4, **HI)
    assert sdk.responses.retrieve(created.id).model_dump() == created.model_dump()
    assert client.get(f"/responses/{created.id}").json()["id"] == created.id  # the alias without /v1
    deleted = client.delete(f"/v1/responses/{created.id}")
    assert deleted.status_code == 200 and deleted.json() == {"id": created.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.responses.retrieve(created.id)
    assert caught.value.body["message"] == f"Response with id '{created.id}' not found."
    assert client.delete(f"/v1/responses/{created.id}").status_code == 404


def test_f2_store_false_is_not_kept(sdk: openai.OpenAI) -> None:
    created = sdk.responses.create(input="Hi", max_output_tokens=2, store=False, **HI)
    assert created.store is False
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(created.id)


# ---- chaining ----

def test_f2_previous_response_id_chains_and_hits_the_prefix_cache(sdk: openai.OpenAI) -> None:
    first = sdk.responses.create(input="My name is Ada.", max_output_tokens=8, **HI)
    second = sdk.responses.create(input="What is my name?", previous_response_id=first.id, max_output_tokens=8, **HI)
    assert second.previous_response_id == first.id
    whole = [{"role": "user", "content": "My name is Ada."},
             {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "What is my name?"}]
    counted = sdk.responses.input_tokens.count(model="m", input=whole)
    assert second.usage.input_tokens == counted.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt was reused (M)
    items = sdk.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in items.data] == ["message", "message", "message"]
    assert items.data[1].id == first.output[0].id and items.data[2].content[0].text == "What is my name?"


def test_f2_unknown_previous_response_id_is_400(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.responses.create(input="x", previous_response_id="resp_missing", **HI)
    assert caught.value.code == "previous_response_not_found"
    assert caught.value.body["param"] == "previous_response_id"


# ---- background and cancel ----

def test_f2_background_runs_to_the_end_and_polls(sdk: openai.OpenAI) -> None:
    created = sdk.responses.create(input="Hi", max_output_tokens=5, background=True, **HI)
    assert created.status == "queued" and created.background is True
    done = wait_for_status(sdk, created.id)
    assert done.status == "incomplete" and done.usage.output_tokens == 5 and done.output_text


def test_f2_background_cancel_aborts_the_generation(sdk: openai.OpenAI) -> None:
    created = sdk.responses.create(input="Count to a thousand.", max_output_tokens=800, background=True,
                                   extra_body={"ignore_eos": True}, **HI)
    cancelled = sdk.responses.cancel(created.id)
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens < 800
    assert sdk.responses.retrieve(created.id).status == "cancelled"
    assert sdk.responses.cancel(created.id).status == "cancelled"  # idempotent


def test_f2_cancel_of_a_foreground_response_is_400(sdk: openai.OpenAI) -> None:
    created = sdk.responses.create(input="Hi", max_output_tokens=2, **HI)
    with pytest.raises(openai.BadRequestError, match="background"):
        sdk.responses.cancel(created.id)


def test_f2_background_stream_and_replay(sdk: openai.OpenAI, client: httpx.Client) -> None:
    live = list(sdk.responses.create(input="Hi", max_output_tokens=4, background=True, stream=True, **HI))
    assert live[0].type == "response.created" and live[0].response.status == "queued"
    assert live[-1].type == "response.incomplete"
    replay = list(sdk.responses.retrieve(live[0].response.id, stream=True, starting_after=3))
    assert [e.model_dump() for e in replay] == [e.model_dump() for e in live[4:]]
    foreground = sdk.responses.create(input="Hi", max_output_tokens=2, **HI)
    refused = client.get(f"/v1/responses/{foreground.id}", params={"stream": "true"})
    assert refused.status_code == 400 and "background" in refused.json()["error"]["message"]


# ---- input_tokens, compact ----

def test_f5_input_tokens_match_create_usage(sdk: openai.OpenAI, client: httpx.Client) -> None:
    counted = sdk.responses.input_tokens.count(model="m", input="Hi", instructions="Be brief.")
    created = sdk.responses.create(input="Hi", instructions="Be brief.", max_output_tokens=1, **HI)
    assert counted.object == "response.input_tokens" and counted.input_tokens == created.usage.input_tokens
    alias = client.post("/responses/input_tokens", json={"input": "Hi", "instructions": "Be brief."})
    assert alias.json() == {"object": "response.input_tokens", "input_tokens": counted.input_tokens}


def test_f2_compact_summarises_older_turns(sdk: openai.OpenAI) -> None:
    first = sdk.responses.create(input="My name is Ada and I like tea.", max_output_tokens=8, **HI)
    second = sdk.responses.create(input="Hi", previous_response_id=first.id, max_output_tokens=8, **HI)
    compacted = sdk.responses.compact(model="m", previous_response_id=second.id, extra_body={"max_output_tokens": 24})
    assert compacted.object == "response.compaction" and compacted.usage.output_tokens <= 24
    kinds = [item.type for item in compacted.output]
    assert kinds == ["compaction", "message", "message"]  # the summary, then the last turn verbatim
    assert compacted.output[0].encrypted_content and compacted.output[2].id == second.output[0].id
    follow_up = [item.model_dump(exclude_none=True, warnings=False) for item in compacted.output]
    follow_up.append({"role": "user", "content": "Thanks!"})
    after = sdk.responses.create(input=follow_up, max_output_tokens=4, **HI)
    assert after.status == "incomplete" and after.output_text


# ---- media (C2) ----

def png_data_url() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (2, 2), "red").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_f2_images_are_validated_then_refused(client: httpx.Client) -> None:
    def with_image(url: str) -> httpx.Response:
        return client.post("/v1/responses", json={"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": url}]}]})
    refused = with_image(png_data_url())
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "the served model does not accept image input"
    broken = with_image("data:image/png;base64,bm90IGFuIGltYWdl")
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_image"


# ---- D1 ----

BODY_ROUTES = ("/v1/responses", "/responses", "/v1/responses/input_tokens", "/responses/input_tokens",
               "/v1/responses/compact", "/responses/compact")


@pytest.fixture(scope="module")
def small_server(start_server: Callable[..., ServerThread]) -> ServerThread:
    """No model and a 4 KiB body limit: every body error must come before the availability check."""
    return start_server(None, ServerConfig(port=0, max_body_bytes=4096))


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_d1_body_errors_before_availability(small_server: ServerThread, path: str) -> None:
    with httpx.Client(base_url=small_server.address, timeout=30) as http:
        def post(content: bytes, content_type: str | None = "application/json") -> httpx.Response:
            headers = {"Content-Type": content_type} if content_type else {}
            return http.post(path, content=content, headers=headers)
        cases = [(post(b"{\"input\": "), 400), (post(b""), 400), (post(b"[1]"), 400), (post(b"{}"), 400),
                 (post(b"{\"input\": 5}"), 400), (post(b"{\"input\": \"x\", \"instructions\": 5}"), 400),
                 (post(b"{\"input\": [{\"role\": \"user\"}]}"), 400),
                 (post(b"{\"input\": \"x\"}", None), 415), (post(b"{\"input\": \"x\"}", "text/plain"), 415),
                 (post(json.dumps({"input": "x" * 5000}).encode()), 413),
                 (post(b"{\"input\": \"x\"}"), 503)]
        for response, status in cases:
            assert response.status_code == status, (path, status, response.text)
            error = response.json()["error"]
            assert error["type"] == ("unavailable_error" if status == 503 else "invalid_request_error")
            assert len(error["message"].encode()) <= 1024


def test_d1_stored_routes_answer_without_a_model(small_server: ServerThread) -> None:
    with httpx.Client(base_url=small_server.address, timeout=30) as http:
        assert http.get("/v1/responses/resp_nope").status_code == 404
        assert http.post("/v1/responses/resp_nope/cancel").status_code == 404
        assert http.get("/v1/responses/resp_nope/input_items").status_code == 404


# ---- restart ----

def test_f2_responses_survive_a_restart(served: ServedModel, tmp_path: Path) -> None:
    """Two servers, one after the other, over the same --responses-db file."""
    config = ServerConfig(port=0, responses_db=tmp_path / "responses.sqlite3")
    first = ServerThread(ServerState(config, served)).start()
    try:
        with openai.OpenAI(base_url=first.address + "/v1", api_key="x", max_retries=0) as client:
            created = client.responses.create(input="Hi", max_output_tokens=4, **HI)
    finally:
        first.stop()
        first.server.state.responses.close()
    second = ServerThread(ServerState(config, served)).start()
    try:
        with openai.OpenAI(base_url=second.address + "/v1", api_key="x", max_retries=0) as client:
            assert client.responses.retrieve(created.id).model_dump() == created.model_dump()
            chained = client.responses.create(input="Again", previous_response_id=created.id, max_output_tokens=2,
                                              **HI)
            assert chained.usage.input_tokens > created.usage.input_tokens
    finally:
        second.stop()
        second.server.state.responses.close()
