"""Request schemas: strict types, extra_body lifting (M), unknown fields ignored, golden reply pieces."""

from __future__ import annotations

import pytest

from mlxcel.api.errors import ApiError
from mlxcel.api.generation import LogprobText
from mlxcel.api.openai.chat import logprobs_json as chat_logprobs
from mlxcel.api.openai.chat import parse_chat_request
from mlxcel.api.openai.common import stop_strings, usage_json
from mlxcel.api.openai.completions import logprobs_json as completion_logprobs
from mlxcel.api.openai.completions import parse_completion_request
from mlxcel.api.schema import flatten_extra_body
from mlxcel.types import Usage

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_m_extra_body_lifted_root_wins() -> None:
    body = {**CHAT, "top_k": 5, "extra_body": {"top_k": 9, "cache_prompt": False}}
    assert flatten_extra_body(body) == {**CHAT, "top_k": 5, "cache_prompt": False}
    req = parse_chat_request(body)
    assert req.top_k == 5 and req.cache_prompt is False
    assert flatten_extra_body([1]) == [1]


def test_unknown_fields_ignored_and_best_of() -> None:
    req = parse_chat_request({**CHAT, "frobnicate": True, "best_of": 1, "response_format": {"type": "text"}})
    assert req.n == 1
    with pytest.raises(ApiError, match="best_of"):
        parse_chat_request({**CHAT, "best_of": 3})


@pytest.mark.parametrize("field,value", [("temperature", "0.5"), ("max_tokens", 1.5), ("n", True),
                                         ("stop", 3), ("messages", "hi"), ("extra_body", "x"),
                                         ("temperature", 3.0), ("top_logprobs", 21)])
def test_d1_strict_types(field: str, value: object) -> None:
    with pytest.raises(ApiError) as info:
        parse_chat_request({**CHAT, field: value})
    assert info.value.status == 400 and field in info.value.message


def test_completion_prompt_forms() -> None:
    for prompt in ("a", ["a", "b"], [1, 2], [[1], [2, 3]]):
        assert parse_completion_request({"model": "m", "prompt": prompt}).prompt == prompt
    assert parse_completion_request({"model": "m", "prompt": "a"}).max_tokens == 16
    with pytest.raises(ApiError):
        parse_completion_request({"model": "m", "prompt": [1, "a"]})


def test_golden_usage_and_logprobs() -> None:
    assert usage_json(Usage(10, 3, cached_tokens=8)) == {
        "prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 8}}
    top = (LogprobText(5, "Hi", -0.1, (72, 105)), LogprobText(6, "Yo", -2.5, (89, 111)))
    entries = [LogprobText(5, "Hi", -0.1, (72, 105), top), LogprobText(7, "!", -0.2, (33,), ())]
    assert chat_logprobs(entries) == {"content": [
        {"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": [
            {"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}, {"token": "Yo", "logprob": -2.5, "bytes": [89, 111]}]},
        {"token": "!", "logprob": -0.2, "bytes": [33], "top_logprobs": []}]}
    assert completion_logprobs(entries, 4) == {
        "tokens": ["Hi", "!"], "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{"Hi": -0.1, "Yo": -2.5}, {}], "text_offset": [4, 6]}
    assert stop_strings("x") == ("x",) and stop_strings(None) == () and stop_strings(["a", "b"]) == ("a", "b")
