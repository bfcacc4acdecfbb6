"""llama-server native adapter (F4) with golden JSON: request fields -> the engine Request, scripted
TokenEvents -> the /completion reply and stream events, prompts, logit_bias forms, tokenize pieces,
infill prompt layout. The engine is scripted (tests/api/scripted_engine.py); the tokenizer is
SmolLM2's real one."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import replace
from typing import Any

import pytest

from mlxcel.api.errors import ApiError, error_body, invalid_request
from mlxcel.api.generation import ChoiceTimings, Generation, GenerationParams, Prompt
from mlxcel.api.llama_server import completion, infill, results
from mlxcel.api.llama_server.schemas import InfillRequest, TokenizeRequest
from mlxcel.api.llama_server.tokenize import piece, tokenize_content
from mlxcel.api.replies import JsonReply, StreamReply
from mlxcel.text.tokenizer import FimTokenIds, Tokenizer
from mlxcel.types import FinishReason, Priority, SamplingParams

from .scripted_engine import ScriptedEngine, scripted_context, smollm2_metadata

PARIS = [7042, 30]  # " Paris."
EOS = 2  # <|im_end|>
PROMPT_IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is"
FIXED = ChoiceTimings(submitted_at=10.0, first_token_at=10.25, finished_at=10.75)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_metadata())


def run(tokenizer: Tokenizer, body: dict[str, Any], engine: ScriptedEngine,
        headers: dict[str, str] | None = None) -> JsonReply | StreamReply:
    ctx = scripted_context(tokenizer, engine)
    req = completion.parse_completion_request(body)
    return asyncio.run(completion.create_completion(ctx, req, headers or {}))


def without_timings(body: dict[str, Any]) -> dict[str, Any]:
    assert set(body["timings"]) == {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
                                    "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}
    return {k: v for k, v in body.items() if k != "timings"}


# ---- request -> engine Request ----

def test_f4_request_fields_reach_the_engine_request(tokenizer: Tokenizer) -> None:
    engine = ScriptedEngine([*PARIS, EOS])
    body = {"prompt": "The capital of France is", "n_predict": 4, "temperature": 0.5, "top_k": 7, "top_p": 0.9,
            "min_p": 0.1, "repeat_penalty": 1.2, "repeat_last_n": 32, "presence_penalty": 0.5,
            "frequency_penalty": 0.25, "seed": 42, "ignore_eos": True, "n_probs": 2, "stop": ["\n"],
            "cache_prompt": False, "id_slot": 1, "logit_bias": [[7042, False], ["Paris", -3], [30, True]]}
    run(tokenizer, body, engine, {"x-priority": "high"})
    [request] = engine.requests
    assert request.prompt_token_ids == PROMPT_IDS
    assert (request.cache_prompt, request.slot_id, request.priority) == (False, 1, Priority.HIGH)
    paris = tokenizer.encode("Paris", add_special_tokens=False)
    assert request.sampling == SamplingParams(
        temperature=0.5, top_k=7, top_p=0.9, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5,
        frequency_penalty=0.25, repeat_last_n=32, seed=42, max_tokens=4, ignore_eos=True, logprobs=2,
        logit_bias=((7042, -math.inf), *((t, -3.0) for t in paris)))


def test_f4_llama_server_defaults(tokenizer: Tokenizer) -> None:
    engine = ScriptedEngine([EOS])
    run(tokenizer, {"prompt": [1, 2, 3], "seed": 0xFFFFFFFF}, engine)
    [request] = engine.requests
    assert request.sampling == SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=None,
                                              max_tokens=None)
    assert (request.cache_prompt, request.slot_id, request.priority) == (True, None, Priority.NORMAL)


def test_f4_max_tokens_alias_and_prefill_only(tokenizer: Tokenizer) -> None:
    fields = completion.parse_completion_request({"prompt": "x", "max_tokens": 7})
    assert completion.completion_options(tokenizer, fields).sampling.max_tokens == 7
    both = completion.parse_completion_request({"prompt": "x", "max_tokens": 7, "n_predict": 2})
    assert completion.completion_options(tokenizer, both).sampling.max_tokens == 2
    zero = completion.parse_completion_request({"prompt": "x", "n_predict": 0})
    assert completion.completion_options(tokenizer, zero).sampling.max_tokens == 1  # the one token is dropped from the reply


# ---- prompts ----

def test_f4_prompt_shapes(tokenizer: Tokenizer) -> None:
    def ids(prompt: Any) -> list[list[int]]:
        return [list(p.token_ids) for p in completion.completion_prompts(tokenizer, prompt)]

    assert ids("The capital of France is") == [PROMPT_IDS]
    assert ids(PROMPT_IDS) == [PROMPT_IDS]
    assert ids([504, 3575, " of France is"]) == [PROMPT_IDS]  # mixed: one prompt
    assert ids(["The capital", 282, 4649, 314]) == [PROMPT_IDS]
    assert ids({"prompt_string": "The capital of France is"}) == [PROMPT_IDS]
    assert ids(["a", "b"]) == [tokenizer.encode("a"), tokenizer.encode("b")]  # only strings: several prompts
    assert ids([[1, 2], "b", [3, "c"]]) == [[1, 2], tokenizer.encode("b"), [3, *tokenizer.encode("c", add_special_tokens=False)]]
    for bad in ([], [True], [1.5], [[]], "", 7, [[1, None]]):
        with pytest.raises(ApiError) as raised:
            completion.completion_prompts(tokenizer, bad)
        assert raised.value.status == 400 and raised.value.message.startswith("prompt")


def test_f4_logit_bias_forms(tokenizer: Tokenizer) -> None:
    assert completion.logit_bias(tokenizer, {"15": 2, "7042": False}) == ((15, 2.0), (7042, -math.inf))
    assert completion.logit_bias(tokenizer, [[15, 1.5], [16, True]]) == ((15, 1.5),)
    assert completion.logit_bias(tokenizer, [[" Paris", -1]]) == ((7042, -1.0),)
    for bad, where in (([[15]], "logit_bias.0"), ({"15": "x"}, "logit_bias.15"), ([[10**9, 1]], "logit_bias.0"),
                       ([[None, 1]], "logit_bias.0"), ({"1": math.nan}, "logit_bias.1")):
        with pytest.raises(ApiError) as raised:
            completion.logit_bias(tokenizer, bad)
        assert raised.value.message.startswith(where)


# ---- TokenEvents -> reply JSON ----

def test_f4_final_json_golden(tokenizer: Tokenizer) -> None:
    reply = run(tokenizer, {"prompt": "The capital of France is", "n_predict": 8, "temperature": 0,
                            "return_tokens": True, "n_probs": 1}, ScriptedEngine([*PARIS, EOS], num_cached=3))
    assert isinstance(reply, JsonReply)
    body = reply.body
    settings = body["generation_settings"]
    assert settings == {
        "n_ctx": 1024, "n_predict": 8, "max_tokens": 8, "seed": 0xFFFFFFFF, "temperature": 0, "top_k": 40,
        "top_p": 0.95, "min_p": 0.05, "typical_p": 1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1,
        "top_n_sigma": -1.0, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "mirostat": 0, "mirostat_tau": 5.0,
        "mirostat_eta": 0.1, "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 64,
        "dry_sequence_breakers": ["\n", ":", '"', "*"], "repeat_last_n": 64, "repeat_penalty": 1.0, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "stop": [], "ignore_eos": False, "stream": False, "logit_bias": [], "n_probs": 1,
        "cache_prompt": True, "adaptive_target": -1.0, "adaptive_decay": 0.9}
    assert body["timings"]["cache_n"] == 3 and body["timings"]["prompt_n"] == 2 and body["timings"]["predicted_n"] == 3
    probs = [{"id": t, "token": tokenizer.decode([t]), "bytes": list(tokenizer.decode([t]).encode()), "logprob": -0.25,
              "top_logprobs": [{"id": t, "token": tokenizer.decode([t]), "bytes": list(tokenizer.decode([t]).encode()),
                                "logprob": -0.25}]} for t in PARIS]
    assert without_timings(body) == {
        "index": 0, "content": " Paris.", "tokens": [*PARIS, EOS], "id_slot": -1, "stop": True,
        "model": "SmolLM2-135M-Instruct", "tokens_predicted": 3, "tokens_evaluated": 5,
        "generation_settings": settings, "prompt": "The capital of France is", "has_new_line": False,
        "truncated": False, "stop_type": "eos", "stopping_word": "", "stopped_eos": True, "stopped_limit": False,
        "stopped_word": False, "tokens_cached": 3, "completion_probabilities": probs}
    json.dumps(body, allow_nan=False)  # what the server sends must be plain JSON


def test_f4_timings_golden(tokenizer: Tokenizer) -> None:
    ctx = scripted_context(tokenizer, ScriptedEngine(PARIS, FinishReason.LENGTH, num_cached=1))
    generation = Generation.start(ctx, [Prompt(tuple(PROMPT_IDS))], GenerationParams(), request_id="t")
    result = replace(asyncio.run(generation.collect())[0], timings=FIXED)
    assert results.timings_json(result, 2) == {
        "cache_n": 1, "prompt_n": 4, "prompt_ms": 250.0, "prompt_per_token_ms": 62.5, "prompt_per_second": 16.0,
        "predicted_n": 2, "predicted_ms": 500.0, "predicted_per_token_ms": 500.0, "predicted_per_second": 2.0}
    # llama-server's rate is over decode steps: the first token comes with the prompt's logits
    one = results.timings_json(result, 1)
    assert (one["predicted_per_token_ms"], one["predicted_per_second"]) == (0.0, 0.0)
    options = results.ReplyOptions("m", -1, False, False, False, context_size=7, settings={})
    body = results.final_json(result, "p", options)
    assert (body["stop_type"], body["stopped_limit"], body["truncated"]) == ("limit", True, True)  # 5 + 2 >= 7


def test_f4_stop_word_and_prefill_only_replies(tokenizer: Tokenizer) -> None:
    stopped = run(tokenizer, {"prompt": "x", "stop": ["."]}, ScriptedEngine([*PARIS, 657, EOS])).body
    assert (stopped["content"], stopped["stop_type"], stopped["stopping_word"], stopped["stopped_word"]) == (
        " Paris", "word", ".", True)
    prefill = run(tokenizer, {"prompt": "x", "n_predict": 0, "return_tokens": True}, ScriptedEngine([7042])).body
    assert (prefill["content"], prefill["tokens_predicted"], prefill["stop_type"]) == ("", 0, "limit")
    assert prefill["timings"]["predicted_n"] == 0


def test_f4_several_prompts_are_an_array(tokenizer: Tokenizer) -> None:
    body = run(tokenizer, {"prompt": ["a", [1, 2]]}, ScriptedEngine([*PARIS, EOS])).body
    assert [b["index"] for b in body] == [0, 1] and [b["prompt"] for b in body] == ["a", "<|im_start|><|im_end|>"]


def stream_payloads(reply: StreamReply) -> list[dict[str, Any]]:
    async def collect() -> list[str]:
        return [frame async for frame in reply.frames]

    frames = asyncio.run(collect())
    assert all(f.startswith("data: ") and f.endswith("\n\n") for f in frames) and "[DONE]" not in "".join(frames)
    return [json.loads(f[len("data: "):]) for f in frames]


def test_f4_stream_events_golden(tokenizer: Tokenizer) -> None:
    reply = run(tokenizer, {"prompt": "The capital of France is", "stream": True, "n_probs": 1, "id_slot": 0},
                ScriptedEngine([*PARIS, EOS]))
    assert isinstance(reply, StreamReply)
    *partials, final = stream_payloads(reply)
    paris, dot = (tokenizer.decode([t]) for t in PARIS)
    assert [{k: v for k, v in p.items() if k != "completion_probabilities"} for p in partials] == [
        {"index": 0, "content": paris, "tokens": [7042], "stop": False, "id_slot": 0, "tokens_predicted": 1,
         "tokens_evaluated": 5},
        {"index": 0, "content": dot, "tokens": [30], "stop": False, "id_slot": 0, "tokens_predicted": 2,
         "tokens_evaluated": 5},
        {"index": 0, "content": "", "tokens": [EOS], "stop": False, "id_slot": 0, "tokens_predicted": 3,
         "tokens_evaluated": 5},
    ]
    assert [p["completion_probabilities"][0]["id"] for p in partials[:2]] == PARIS
    assert final["stop"] is True and final["content"] == "" and final["tokens"] == []
    assert final["tokens_predicted"] == 3 and final["stop_type"] == "eos" and "completion_probabilities" not in final


def test_f4_stream_error_event() -> None:
    assert error_body(invalid_request("bad")) == {"error": {"message": "bad", "type": "invalid_request_error",
                                                            "code": 400}}


# ---- tokenize and infill ----

def test_f4_tokenize_pieces(tokenizer: Tokenizer) -> None:
    pieces = tokenize_content(tokenizer, TokenizeRequest(content="hi 🦙", with_pieces=True)).body["tokens"]
    assert pieces[0] == {"id": 6004, "piece": "hi"}
    assert all(isinstance(p["piece"], list) for p in pieces[1:])  # the emoji's bytes, split over tokens
    assert b"".join(bytes(p["piece"]) for p in pieces[1:]) == " 🦙".encode()
    assert piece(tokenizer, 1) == "<|im_start|>"
    assert tokenize_content(tokenizer, TokenizeRequest(content="<|im_start|>")).body == {"tokens": [1]}


class FimTokenizer:
    """SmolLM2's tokenizer with FIM ids given explicitly (what a FIM-trained vocabulary declares)."""

    def __init__(self, base: Tokenizer, fim: FimTokenIds) -> None:
        self.base = base
        self.fim_token_ids = fim
        self.bos_token_id = None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.base.encode(text, add_special_tokens=add_special_tokens)


def test_f4_infill_prompt_layout(tokenizer: Tokenizer) -> None:
    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    req = InfillRequest(input_prefix="def f(", input_suffix="):", prompt="x",
                        input_extra=[{"filename": "a.py", "text": "A = 1"}])
    repo_level = FimTokenizer(tokenizer, FimTokenIds(prefix=90, suffix=91, middle=92, repo=3, sep=5))
    assert infill.infill_token_ids(repo_level, req) == [  # type: ignore[arg-type]
        3, *enc("myproject\n"), 5, *enc("a.py\n"), *enc("A = 1"), 5, *enc("filename\n"),
        90, *enc("def f("), 91, *enc("):"), 92, *enc("x")]
    plain = FimTokenizer(tokenizer, FimTokenIds(prefix=90, suffix=91, middle=92))
    assert infill.infill_token_ids(plain, req) == [  # type: ignore[arg-type]
        *enc("\n\n--- snippet ---\n\n"), *enc("A = 1"), 90, *enc("def f("), 91, *enc("):"), 92, *enc("x")]
    with pytest.raises(ApiError) as raised:
        infill.infill_token_ids(tokenizer, req)
    assert raised.value.status == 400 and "prefix (<fim_prefix> / <|fim_prefix|>)" in raised.value.message


def test_server_sampling_defaults_fill_only_the_fields_a_request_left_out() -> None:
    """Issue 13 (F9): --temp / --top-k ... replace llama-server's request defaults; a sent field wins."""
    from mlxcel.api.context import SamplingDefaults

    unset = completion.parse_completion_request({"prompt": "x"})
    # No server value and no checkpoint value: llama-server's own defaults, which the native schema has already.
    assert completion.with_server_defaults(unset, SamplingDefaults()).model_dump() == unset.model_dump()
    server = SamplingDefaults(temperature=0.2, top_k=5, repeat_penalty=1.3)
    filled = completion.with_server_defaults(unset, server)
    assert (filled.temperature, filled.top_k, filled.repeat_penalty, filled.top_p) == (0.2, 5, 1.3, 0.95)
    sent = completion.with_server_defaults(
        completion.parse_completion_request({"prompt": "x", "temperature": 0.9, "top_k": 40}), server)
    assert (sent.temperature, sent.top_k, sent.repeat_penalty) == (0.9, 40, 1.3)  # 40 sent is kept, not "unset"
