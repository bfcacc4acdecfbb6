"""OpenAI routes (F1, F5, L, M) on the real default model, driven by the official `openai` SDK and httpx.

All at temperature 0 with a handful of tokens, so outputs are deterministic and cheap.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from mlxcel.server.lifecycle import ServerThread

from .conftest import chat_body

pytestmark = pytest.mark.slow
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture()
def sdk(server: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.address + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def test_f1_chat_non_streaming(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(model="any", messages=HI, max_tokens=6, temperature=0)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == "SmolLM2-135M-Instruct"
    assert choice.message.role == "assistant" and choice.message.content.startswith("Hello")
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 6 and reply.usage.prompt_tokens > 10
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 6


def test_f1_chat_streaming_equals_non_streaming_with_usage_chunk(sdk: openai.OpenAI) -> None:
    whole = sdk.chat.completions.create(model="m", messages=HI, max_tokens=6, temperature=0)
    chunks = list(sdk.chat.completions.create(model="m", messages=HI, max_tokens=6, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


def test_f1_chat_content_parts_and_developer_text(sdk: openai.OpenAI) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    a = sdk.chat.completions.create(model="m", messages=parts, max_tokens=4, temperature=0)
    b = sdk.chat.completions.create(model="m", messages=HI, max_tokens=4, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_f1_chat_logprobs(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(model="m", messages=HI, max_tokens=4, temperature=0, logprobs=True,
                                        top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(e.token for e in content) == reply.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the best
        assert bytes(entry.bytes).decode() == entry.token


def test_f1_chat_n_choices_with_seed(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(model="m", messages=HI, max_tokens=5, temperature=1.0, seed=7, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.completion_tokens == 15
    again = sdk.chat.completions.create(model="m", messages=HI, max_tokens=5, temperature=1.0, seed=7, n=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]


def test_f1_chat_stop_string(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(model="m", messages=HI, max_tokens=10, temperature=0, stop=["!"])
    assert reply.choices[0].message.content == "Hello"
    assert reply.choices[0].finish_reason == "stop"
    chunks = list(sdk.chat.completions.create(model="m", messages=HI, max_tokens=10, temperature=0, stop="!",
                                              stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_f1_max_completion_tokens_and_extras(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(model="m", messages=HI, max_completion_tokens=3, temperature=0,
                                        extra_body={"top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0,
                                                    "ignore_eos": True, "min_tokens": 2})
    assert reply.usage.completion_tokens == 3


def test_m_cached_tokens_and_cache_prompt_false(client: httpx.Client) -> None:
    body = chat_body("Tell me a short fact about the sea, please, in one line.", max_tokens=2)
    client.post("/v1/chat/completions", json=body)
    warm = client.post("/v1/chat/completions", json=body).json()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    for cold_body in ({**body, "cache_prompt": False}, {**body, "extra_body": {"cache_prompt": False}}):
        cold = client.post("/v1/chat/completions", json=cold_body).json()
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert cold["choices"][0]["message"] == warm["choices"][0]["message"]


def test_l_priority_header(client: httpx.Client) -> None:
    assert client.post("/v1/chat/completions", json=chat_body(max_tokens=1), headers={"X-Priority": "high"}).is_success
    response = client.post("/v1/chat/completions", json=chat_body(max_tokens=1), headers={"X-Priority": "urgent"})
    assert response.status_code == 400 and "X-Priority" in response.json()["error"]["message"]


def test_f5_input_tokens_match_usage(client: httpx.Client) -> None:
    for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
        counted = client.post(path, json=chat_body()).json()
        assert counted["object"] == "chat.completion.input_tokens"
        usage = client.post("/chat/completions", json=chat_body(max_tokens=1)).json()["usage"]
        assert counted["input_tokens"] == usage["prompt_tokens"]


def test_f1_completions(sdk: openai.OpenAI) -> None:
    one = sdk.completions.create(model="m", prompt="The capital of France is", max_tokens=3, temperature=0)
    assert one.object == "text_completion" and one.choices[0].text.startswith(" Paris")
    ids = sdk.completions.create(model="m", prompt=[504, 3575, 282, 4649, 314], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 5
    many = sdk.completions.create(model="m", prompt=["The capital of France is", "1, 2, 3,"], max_tokens=3,
                                  temperature=0, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == one.choices[0].text
    assert many.usage.completion_tokens == 12


def test_f1_completions_echo_and_logprobs(sdk: openai.OpenAI) -> None:
    reply = sdk.completions.create(model="m", prompt="The capital of France is", max_tokens=3, temperature=0,
                                   echo=True, logprobs=2)
    choice = reply.choices[0]
    assert choice.text.startswith("The capital of France is Paris")
    lp = choice.logprobs  # issue 27: the echoed prompt's tokens come first, the first one's logprob null
    num_prompt = reply.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == num_prompt + 3
    assert lp.text_offset[0] == 0 and lp.text_offset[num_prompt] == len("The capital of France is")
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(len(top) == 2 for top in lp.top_logprobs[num_prompt:])
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:num_prompt])  # the 2 best and the token itself


def test_f1_completions_streaming_with_usage(sdk: openai.OpenAI) -> None:
    chunks = list(sdk.completions.create(model="m", prompt="The capital of France is", max_tokens=3, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices).startswith(" Paris")
    assert chunks[-1].usage.completion_tokens == 3


def test_f1_models(sdk: openai.OpenAI, client: httpx.Client) -> None:
    models = sdk.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
    assert sdk.models.retrieve("SmolLM2-135M-Instruct").owned_by == "mlxcel"
    assert client.get("/models").json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("gpt-4")


def test_bad_requests_get_400(client: httpx.Client) -> None:
    cases = [
        chat_body(best_of=2), chat_body(logprobs=False, top_logprobs=2),
        chat_body(logit_bias={"not-a-token": 1}), chat_body(stop_token_ids=[10**9]),
        chat_body(chat_template_kwargs={"messages": []}), chat_body(messages=[{"role": "user", "content": None}]),
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    ]
    for body in cases:
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, body
    assert client.post("/v1/completions", json={"model": "m", "prompt": []}).status_code == 400
    assert client.post("/v1/completions", json={"model": "m", "prompt": [10**9]}).status_code == 400
    assert client.post("/v1/chat/completions", json=chat_body(best_of=1, max_tokens=1)).is_success


def test_context_overflow_gets_400(client: httpx.Client) -> None:
    long = "hello " * 1100  # over the 1024-token slot context
    for path, body in (("/v1/chat/completions", chat_body(long)),
                       ("/v1/completions", {"model": "m", "prompt": long, "stream": True})):
        response = client.post(path, json=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["type"] == "exceed_context_size_error" and error["n_ctx"] == 1024
