"""Prompt logprobs over HTTP (issue 27 point 2): `/v1/completions` with `echo` + `logprobs` (and
`max_tokens: 0`) in OpenAI's legacy shape, and vLLM's `prompt_logprobs`, on the real default model;
the values equal the logits the engine's prompt path computes, taken in-process."""

from __future__ import annotations

import json
import queue
import uuid

import httpx
import openai
import pytest
import torch

from mlxcel.serving.served_model import ServedModel
from mlxcel.types import Request, SamplingParams

pytestmark = pytest.mark.slow

TEXT = "The capital of France is Paris. The capital of Italy is"


def engine_logprobs(served: ServedModel, ids: list[int]) -> torch.Tensor:
    """log_softmax of every prompt position's logits, taken from the engine in-process (Request.prompt_logits):
    row p scores token p + 1."""
    rows: list[torch.Tensor] = []
    events: queue.SimpleQueue = queue.SimpleQueue()
    request = Request(f"ref-{uuid.uuid4().hex[:8]}", ids, SamplingParams(temperature=0.0, max_tokens=0),
                      prompt_logits=lambda first, logits: rows.append(torch.log_softmax(logits.cpu(), dim=-1)))
    served.engine.core.submit(request, events.put)
    while events.get(timeout=120).finish_reason is None:
        pass
    return torch.cat(rows)


def test_echo_logprobs_max_tokens_zero_is_the_legacy_shape_with_the_prompts_logprobs(server, served) -> None:
    ids = served.tokenizer.encode(TEXT, add_special_tokens=True)
    sdk = openai.OpenAI(base_url=server.address + "/v1", api_key="x", max_retries=0)
    reply = sdk.completions.create(model="m", prompt=TEXT, echo=True, logprobs=2, max_tokens=0, temperature=0)
    choice = reply.choices[0]
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert "".join(lp.tokens) == TEXT and lp.text_offset[0] == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = engine_logprobs(served, ids)
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(float(ref[p - 1, ids[p]]), abs=1e-5)
        values = ref[p - 1].topk(2).values.tolist()
        top = lp.top_logprobs[p]
        assert lp.tokens[p] in top and 2 <= len(top) <= 3  # the 2 best and the token itself
        assert max(top.values()) == pytest.approx(values[0], abs=1e-5)


def test_echo_logprobs_with_one_generated_token_appends_it(server, served) -> None:
    """What lm-eval's local-completions sends for a loglikelihood request: the prompt's entries, then
    the generated token's (an end token included), so token_logprobs[ctxlen:-1] is the continuation."""
    ids = served.tokenizer.encode(TEXT, add_special_tokens=True)
    body = {"model": "m", "prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0,
            "seed": 1234}
    reply = httpx.post(server.address + "/v1/completions", json=body, timeout=120).json()
    lp = reply["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1
    alone = httpx.post(server.address + "/v1/completions", timeout=120,
                       json={**body, "max_tokens": 0}).json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][:len(ids)] == alone["token_logprobs"]
    assert reply["choices"][0]["text"].startswith(TEXT)


def test_vllm_prompt_logprobs_field_and_a_stream(server, served) -> None:
    ids = served.tokenizer.encode(TEXT, add_special_tokens=True)
    body = {"model": "m", "prompt": TEXT, "prompt_logprobs": 1, "max_tokens": 2, "temperature": 0}
    choice = httpx.post(server.address + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    prompt = choice["prompt_logprobs"]
    assert len(prompt) == len(ids) and prompt[0] is None
    ref = engine_logprobs(served, ids)
    for p in range(1, len(ids)):
        entry = prompt[p][str(ids[p])]
        assert entry["logprob"] == pytest.approx(float(ref[p - 1, ids[p]]), abs=1e-5)
        assert entry["rank"] == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
        assert str(int(ref[p - 1].argmax())) in prompt[p]
    assert choice["logprobs"] is None  # legacy logprobs were not asked
    with httpx.stream("POST", server.address + "/v1/completions", timeout=120,
                      json={**body, "stream": True, "echo": True, "logprobs": 0}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"] == TEXT and first["prompt_logprobs"] == prompt
    assert first["logprobs"]["token_logprobs"][1:] == [prompt[p][str(ids[p])]["logprob"] for p in range(1, len(ids))]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == TEXT + choice["text"]


def test_a_cached_prompt_is_scored_again_not_skipped(server, served) -> None:
    body = {"model": "m", "prompt": TEXT * 3, "echo": True, "logprobs": 0, "max_tokens": 0, "temperature": 0}
    httpx.post(server.address + "/v1/completions", json={**body, "logprobs": None, "echo": False, "max_tokens": 1},
               timeout=120)  # donates the prompt's blocks to the prefix cache
    first = httpx.post(server.address + "/v1/completions", json=body, timeout=120).json()
    second = httpx.post(server.address + "/v1/completions", json=body, timeout=120).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["choices"][0]["logprobs"] == second["choices"][0]["logprobs"]


def test_bad_prompt_logprobs_values_are_400_naming_the_field(server) -> None:
    for field, value in (("prompt_logprobs", 21), ("prompt_logprobs", -1), ("max_tokens", -1)):
        reply = httpx.post(server.address + "/v1/completions", timeout=30,
                           json={"model": "m", "prompt": "Hi", field: value})
        assert reply.status_code == 400 and field in reply.json()["error"]["message"]
