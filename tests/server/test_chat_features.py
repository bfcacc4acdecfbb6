"""Chat intelligence through the real HTTP server and the openai SDK (S, R, Q, P, V), on a tiny
scripted thinking/tool-calling model (scripted_model.py): its greedy reply to any chat prompt is
`<think>`-primed reasoning, `</think>`, then a Hermes `<tool_call>` for get_weather(city=Paris).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from mlxcel.config import EngineConfig
from mlxcel.serving.chat_model import start_served_model
from mlxcel.serving.served_model import RuntimeOptions, ServedModel
from mlxcel.server.lifecycle import ServerThread
from mlxcel.chat.plan import FeatureSettings
from tests.server.scripted_model import ARGUMENTS, CALL, REASONING, REASONING_TEXT, WEATHER_TOOL, write_scripted_model

QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = "".join(CALL)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedModel]:
    from mlxcel.loading import resolve_model

    folder = write_scripted_model(tmp_path_factory.mktemp("scripted") / "model")
    # A server default kwarg (S): the template prints `note` as a system turn.
    options = RuntimeOptions(warmup=False, quantize="off", chat=FeatureSettings(chat_template_kwargs='{"note": "srv"}'))
    model = start_served_model(resolve_model(str(folder)), options, EngineConfig(max_num_seqs=2, ctx_size=4096))
    yield model
    model.close(30)


@pytest.fixture(scope="module")
def server_t(scripted: ServedModel, start_server: Callable[..., ServerThread]) -> ServerThread:
    return start_server(scripted)


@pytest.fixture()
def http(server_t: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server_t.address, timeout=60) as client:
        yield client


@pytest.fixture()
def sdk(server_t: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server_t.address + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": QUESTION, "temperature": 0, "max_tokens": 40, **fields}


# ---- tools (V) ----

def test_v_health_reports_the_templates_tool_call_parser(http: httpx.Client) -> None:
    assert http.get("/health").json()["tool_call_parser"] == "hermes"


def test_v_streamed_tool_call_assembled_by_the_openai_sdk(sdk: openai.OpenAI) -> None:
    with sdk.chat.completions.stream(model="m", messages=QUESTION, tools=[WEATHER_TOOL], temperature=0,
                                     max_tokens=40) as stream:
        completion = stream.get_final_completion()
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == ARGUMENTS


def test_v_stream_sends_id_and_name_once_then_argument_fragments(sdk: openai.OpenAI) -> None:
    chunks = list(sdk.chat.completions.create(model="m", messages=QUESTION, tools=[WEATHER_TOOL], temperature=0,
                                              max_tokens=40, stream=True))
    calls = [c for chunk in chunks for c in (chunk.choices[0].delta.tool_calls or [])]
    named = [c for c in calls if c.id is not None]
    assert [(c.index, c.type, c.function.name) for c in named] == [(0, "function", "get_weather")]
    assert all(c.id is None and c.function.name is None for c in calls if c is not named[0])
    fragments = [c.function.arguments for c in calls if c.function.arguments]
    assert len(fragments) >= 2 and json.loads("".join(fragments)) == ARGUMENTS  # streamed in pieces
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(chunk.choices[0].delta.content for chunk in chunks)  # no markup leaks into content


def test_v_non_streamed_tool_call_with_reasoning(sdk: openai.OpenAI) -> None:
    completion = sdk.chat.completions.create(model="m", messages=QUESTION, tools=[WEATHER_TOOL], temperature=0,
                                             max_tokens=40)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == ARGUMENTS
    extra = choice.message.model_extra
    assert extra["reasoning_content"] == extra["reasoning"] == REASONING_TEXT


def test_v_tool_choice_none_leaves_the_call_as_text(http: httpx.Client) -> None:
    body = http.post("/v1/chat/completions", json=chat(tools=[WEATHER_TOOL], tool_choice="none")).json()
    message = body["choices"][0]["message"]
    assert "tool_calls" not in message and body["choices"][0]["finish_reason"] == "stop"
    assert message["content"] == f"<tool_call>{CALL_TEXT}</tool_call>"


@pytest.mark.parametrize("choice", ["sometimes", {"type": "function", "function": {"name": "missing"}}])
def test_v_bad_tool_choice_is_a_400(http: httpx.Client, choice: Any) -> None:
    reply = http.post("/v1/chat/completions", json=chat(tools=[WEATHER_TOOL], tool_choice=choice, stream=True))
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


# ---- reasoning (Q, R) ----

def test_q_reasoning_streams_as_reasoning_from_the_first_token(sdk: openai.OpenAI) -> None:
    """The template primes `<think>\\n`: the reply's first tokens are reasoning, without markers."""
    chunks = list(sdk.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=40,
                                              stream=True))
    reasoning = [c.choices[0].delta.model_extra.get("reasoning_content") for c in chunks if c.choices]
    assert "".join(r for r in reasoning if r) == REASONING_TEXT
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == f"<tool_call>{CALL_TEXT}</tool_call>"  # no tools asked: the markup is content


def test_r_budget_forces_the_end_of_reasoning(sdk: openai.OpenAI) -> None:
    completion = sdk.chat.completions.create(model="m", messages=QUESTION, tools=[WEATHER_TOOL], temperature=0,
                                             max_tokens=40, extra_body={"thinking_budget_tokens": 1})
    message = completion.choices[0].message
    assert message.model_extra["reasoning_content"] == REASONING[0]  # one reasoning token, then </think>
    assert json.loads(message.tool_calls[0].function.arguments) == ARGUMENTS


def test_r_forced_end_marker_is_an_ordinary_delta_that_stop_strings_skip(http: httpx.Client) -> None:
    """Raw completion: the forced `</think>` streams as text and does not trigger a `</think>` stop;
    the model's own `</think>` does."""
    prompt = http.post("/apply-template", json={"messages": QUESTION}).json()["prompt"]
    fields = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": ["</think>"]}
    budgeted = http.post("/v1/completions", json={**fields, "thinking_budget_tokens": 1, "stream": True})
    events = [json.loads(line[6:]) for line in budgeted.text.splitlines() if line.startswith("data: {")]
    texts = [e["choices"][0]["text"] for e in events]
    assert "</think>" in texts or any(t.startswith("</think>") for t in texts)
    assert "".join(texts) == f"{REASONING[0]}</think>\n\n{CALL_TEXT}"  # <tool_call> is special: skipped
    free = http.post("/v1/completions", json=fields).json()["choices"][0]
    assert free["text"] == REASONING_TEXT + "\n" and free["finish_reason"] == "stop"


def test_r_native_completion_budget(http: httpx.Client) -> None:
    prompt = http.post("/apply-template", json={"messages": QUESTION}).json()["prompt"]
    body = http.post("/completion", json={"prompt": prompt, "n_predict": 30, "temperature": 0,
                                          "thinking_budget": 0}).json()
    assert body["content"].startswith("</think>")


@pytest.mark.parametrize(("fields", "message"), [
    ({"thinking_budget_tokens": -2}, "thinking_budget_tokens"),
    ({"thinking_budget_tokens": 50, "max_tokens": 10}, "max_tokens"),
    ({"thinking_token_budget": "8"}, "thinking_token_budget"),
])  # fmt: skip
def test_r_invalid_budget_is_a_400_before_streaming(http: httpx.Client, fields: dict[str, Any], message: str) -> None:
    reply = http.post("/v1/chat/completions", json=chat(stream=True, **fields))
    assert reply.status_code == 400 and message in reply.json()["error"]["message"]
    raw = http.post("/completion", json={"prompt": "x", "n_predict": 10, **{"thinking_budget_tokens": -3}})
    assert raw.status_code == 400


def test_r_primary_budget_field_wins_over_aliases(http: httpx.Client) -> None:
    body = chat(thinking_budget_tokens=1, thinking_budget=-7)  # the alias is not even read
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["reasoning_content"] == REASONING[0]


def test_stop_strings_apply_to_the_answer_not_the_reasoning(http: httpx.Client) -> None:
    body = http.post("/v1/chat/completions", json=chat(stop=["Paris"])).json()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == REASONING_TEXT  # "Paris" in the reasoning did not stop it
    assert message["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "'
    assert body["choices"][0]["finish_reason"] == "stop"


# ---- template kwargs (S) ----

def test_s_template_kwargs_precedence(http: httpx.Client) -> None:
    """request chat_template_kwargs > extra_body.chat_template_kwargs > server default, per key."""
    def prompt(**fields: Any) -> str:
        return http.post("/apply-template", json={"messages": QUESTION, **fields}).json()["prompt"]

    assert prompt().startswith("<|im_start|>system\nsrv<|im_end|>")
    nested = {"extra_body": {"chat_template_kwargs": {"note": "extra"}}}
    assert prompt(**nested).startswith("<|im_start|>system\nextra<|im_end|>")
    both = prompt(chat_template_kwargs={"note": "root"}, **nested)
    assert both.startswith("<|im_start|>system\nroot<|im_end|>") and both.endswith("<think>\n")  # enable_thinking kept
    off = prompt(chat_template_kwargs={"enable_thinking": False})
    assert off.startswith("<|im_start|>system\nsrv") and off.endswith("assistant\n")


def test_s_input_tokens_and_generation_use_the_same_kwargs(http: httpx.Client) -> None:
    def count(**fields: Any) -> int:
        return http.post("/v1/chat/completions/input_tokens", json=chat(**fields)).json()["input_tokens"]

    assert count(chat_template_kwargs={"note": "longer note"}) == count() + len("longer note") - len("srv")
    body = http.post("/v1/chat/completions", json=chat(chat_template_kwargs={"enable_thinking": False})).json()
    message = body["choices"][0]["message"]
    assert "reasoning_content" not in message  # not primed: the reasoning text is plain content
    assert message["content"].startswith(REASONING_TEXT)
    assert body["usage"]["prompt_tokens"] == count(chat_template_kwargs={"enable_thinking": False})


# ---- reasoning echo (Q) ----

def _padded_question(http: httpx.Client) -> list[dict[str, str]]:
    """A question whose prompt plus the reasoning tokens (2 and `</think>`) fill whole KV blocks
    of 16, so a cache hit that covers the reasoning shows as one more cached block."""
    size = http.post("/v1/chat/completions/input_tokens", json=chat()).json()["input_tokens"]
    pad = -(size + 3) % 16
    return [{"role": "user", "content": "Weather in Paris?" + "!" * pad}]


def test_q_reasoning_echo_makes_the_follow_up_hit_the_prefix_cache(http: httpx.Client) -> None:
    question = _padded_question(http)
    first = http.post("/v1/chat/completions", json=chat(messages=question, user="alice")).json()
    assert first["choices"][0]["message"]["reasoning_content"] == REASONING_TEXT
    num_first = first["usage"]["prompt_tokens"]
    assert (num_first + 3) % 16 == 0
    answer = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}  # content only
    follow_up = [*question, answer, {"role": "user", "content": "And Rome?"}]
    echoed = http.post("/v1/chat/completions", json=chat(messages=follow_up, user="alice", max_tokens=1)).json()
    # Another session finds nothing to echo: its prompt differs from the first turn's right after it.
    plain = http.post("/v1/chat/completions", json=chat(messages=follow_up, user="bob", max_tokens=1)).json()
    cached = echoed["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= num_first + 3  # the first turn's prompt, its reasoning and </think>
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] < num_first
    assert echoed["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]  # the reasoning was put back


# ---- loop guard (P) ----

def test_p_loop_guard_ends_a_repeating_generation(http: httpx.Client) -> None:
    """After its script the model repeats <|im_end|>; with ignore_eos that is a loop of one token."""
    fields = chat(ignore_eos=True, max_tokens=60)
    looped = http.post("/v1/chat/completions", json={**fields, "max_pattern_size": 2, "min_count": 3}).json()
    assert looped["choices"][0]["finish_reason"] == "loop"
    assert looped["usage"]["completion_tokens"] < 20
    free = http.post("/v1/chat/completions", json=fields).json()
    assert free["choices"][0]["finish_reason"] == "length" and free["usage"]["completion_tokens"] == 60
    bad = http.post("/v1/chat/completions", json={**fields, "min_count": 1})
    assert bad.status_code == 400


def test_scripted_model_writes_its_script(scripted: ServedModel) -> None:
    """The fixture itself: the reply tokens are the script's pieces, one token each."""
    tokenizer = scripted.tokenizer
    ids = tokenizer.encode(REASONING_TEXT + "\n</think>", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids] == [*REASONING, "</think>"]


# ---- Anthropic Messages (E1 with V, R, Q) ----

CLAUDE_TOOL = {"name": "get_weather", "description": "Current weather",
               "input_schema": WEATHER_TOOL["function"]["parameters"]}


@pytest.fixture()
def claude(server_t: ServerThread) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server_t.address, api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def test_e1_v_tool_use_streamed_by_the_anthropic_sdk(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(model="claude-x", max_tokens=40, messages=QUESTION, tools=[CLAUDE_TOOL]) as stream:
        kinds = [event.delta.type for event in stream if event.type == "content_block_delta"]
        message = stream.get_final_message()
    assert message.stop_reason == "tool_use"
    assert "input_json_delta" in kinds and "thinking_delta" not in kinds  # thinking not enabled: hidden
    (tool_use,) = [b for b in message.content if b.type == "tool_use"]
    assert tool_use.name == "get_weather" and tool_use.input == ARGUMENTS


def test_e1_r_thinking_block_when_enabled_with_its_budget(claude: anthropic.Anthropic) -> None:
    thinking = {"type": "enabled", "budget_tokens": 1}
    message = claude.messages.create(model="claude-x", max_tokens=40, messages=QUESTION, tools=[CLAUDE_TOOL],
                                     thinking=thinking)
    assert [b.type for b in message.content] == ["thinking", "tool_use"]
    assert message.content[0].thinking == REASONING[0]  # the budget forced </think> after one token
    with claude.messages.stream(model="claude-x", max_tokens=40, messages=QUESTION, thinking=thinking,
                                tools=[CLAUDE_TOOL]) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "tool_use"] and streamed.stop_reason == "tool_use"


def test_e1_v_tool_choice_none_and_bad_tool_choice(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(model="claude-x", max_tokens=40, messages=QUESTION, tools=[CLAUDE_TOOL],
                                     tool_choice={"type": "none"})
    assert message.stop_reason == "end_turn" and [b.type for b in message.content] == ["text"]
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="claude-x", max_tokens=40, messages=QUESTION, tools=[CLAUDE_TOOL],
                               tool_choice={"type": "tool", "name": "missing"})


# ---- Responses (F2 with V, R) ----

RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL["function"]["parameters"]}


def test_f2_v_function_call_and_reasoning_items(sdk: openai.OpenAI) -> None:
    response = sdk.responses.create(model="m", input="Weather in Paris?", tools=[RESPONSES_TOOL], temperature=0,
                                    max_output_tokens=40, store=False)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "function_call"] and response.status == "completed"
    assert response.output[0].content[0].text == REASONING_TEXT
    call = response.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == ARGUMENTS and call.call_id.startswith("call_")


def test_f2_v_streamed_function_call_arguments(sdk: openai.OpenAI) -> None:
    events = list(sdk.responses.create(model="m", input="Weather in Paris?", tools=[RESPONSES_TOOL], temperature=0,
                                       max_output_tokens=40, store=False, stream=True))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) >= 2 and "".join(deltas) == done.arguments and json.loads(done.arguments) == ARGUMENTS
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == REASONING_TEXT and events[-1].type == "response.completed"
