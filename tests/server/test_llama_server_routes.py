"""llama-server native routes (F4) on the real default model, over httpx: /completion(s), /tokenize,
/detokenize, /apply-template, /infill (400 on SmolLM2, which has no FIM tokens; a real answer from a
tiny random llama whose vocabulary has them), and their errors in llama-server's envelope (D1).

All at temperature 0 with a handful of tokens, so outputs are deterministic and cheap.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxcel.serving.served_model import ServedModel
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread

from .conftest import chat_body

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"
FINAL_KEYS = {"index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted", "tokens_evaluated",
              "generation_settings", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word",
              "stopped_eos", "stopped_limit", "stopped_word", "tokens_cached", "timings"}
TIMING_KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
               "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}


def complete(client: httpx.Client, prompt: Any, path: str = "/completion", **fields: Any) -> dict[str, Any]:
    response = client.post(path, json={"prompt": prompt, "n_predict": 4, "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def stream_events(client: httpx.Client, body: dict[str, Any], path: str = "/completion") -> list[dict[str, Any]]:
    events = []
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
            else:
                assert line == "" or line.startswith(":"), line  # only data events and keepalive comments
    return events


def tokenize(client: httpx.Client, content: str, **fields: Any) -> list[Any]:
    response = client.post("/tokenize", json={"content": content, **fields})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


# ---- /completion ----

def test_f4_completion_native_shape(client: httpx.Client) -> None:
    body = complete(client, PROMPT)
    assert FINAL_KEYS <= body.keys() and TIMING_KEYS <= body["timings"].keys()
    assert body["content"].startswith(" Paris") and body["stop"] is True
    assert body["tokens_predicted"] == 4 and body["tokens_evaluated"] == len(tokenize(client, PROMPT))
    assert (body["stop_type"], body["stopped_limit"], body["stopped_eos"], body["stopped_word"]) == ("limit", True,
                                                                                                    False, False)
    assert body["model"] == "SmolLM2-135M-Instruct" and body["prompt"] == PROMPT and body["tokens"] == []
    assert body["timings"]["predicted_n"] == 4 and body["timings"]["prompt_n"] + body["tokens_cached"] == 5
    settings = body["generation_settings"]
    assert (settings["n_predict"], settings["temperature"], settings["top_k"], settings["seed"]) == (4, 0, 40,
                                                                                                    0xFFFFFFFF)
    assert "completion_probabilities" not in body
    assert complete(client, PROMPT, "/completions")["content"] == body["content"]  # the alias


def test_f4_token_mixed_and_object_prompts_match_the_string(client: httpx.Client) -> None:
    text = complete(client, PROMPT)["content"]
    ids = tokenize(client, PROMPT)
    assert complete(client, ids)["content"] == text
    head = tokenize(client, "The capital of")
    assert complete(client, [*head, " France is"])["content"] == text
    assert complete(client, ["The capital", *tokenize(client, " of France is")])["content"] == text
    assert complete(client, {"prompt_string": PROMPT})["content"] == text
    by_ids = complete(client, ids, return_tokens=True)
    assert by_ids["prompt"] == PROMPT and len(by_ids["tokens"]) == 4  # token prompts are echoed decoded


def test_f4_several_prompts_answer_an_array(client: httpx.Client) -> None:
    bodies = client.post("/completion", json={"prompt": [PROMPT, "1, 2, 3,"], "n_predict": 3,
                                              "temperature": 0}).json()
    assert isinstance(bodies, list) and [b["index"] for b in bodies] == [0, 1]
    assert bodies[0]["content"] == complete(client, PROMPT, n_predict=3)["content"]
    assert bodies[1]["prompt"] == "1, 2, 3,"


def test_f4_stream_events(client: httpx.Client) -> None:
    whole = complete(client, PROMPT, n_predict=5, return_tokens=True)
    events = stream_events(client, {"prompt": PROMPT, "n_predict": 5, "temperature": 0, "stream": True})
    *partials, final = events
    assert all(e["stop"] is False for e in partials) and final["stop"] is True
    assert "".join(e["content"] for e in partials) == whole["content"]
    assert [t for e in partials for t in e["tokens"]] == whole["tokens"]
    assert [e["tokens_predicted"] for e in partials][-1] == 5
    assert all(e["tokens_evaluated"] == whole["tokens_evaluated"] for e in partials)
    assert FINAL_KEYS <= final.keys() and final["content"] == "" and final["tokens"] == []
    assert final["tokens_predicted"] == 5 and final["stop_type"] == "limit"


def test_f4_n_probs(client: httpx.Client) -> None:
    body = complete(client, PROMPT, n_probs=3, return_tokens=True)
    probs = body["completion_probabilities"]
    assert [p["id"] for p in probs] == body["tokens"]
    assert "".join(p["token"] for p in probs) == body["content"]
    for entry in probs:
        assert len(entry["top_logprobs"]) == 3 and entry["logprob"] <= 0
        assert entry["top_logprobs"][0]["id"] == entry["id"]  # greedy picks the best
        assert bytes(entry["bytes"]).decode() == entry["token"]
    events = stream_events(client, {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "stream": True,
                                    "n_probs": 2})
    streamed = [p for e in events[:-1] for p in e["completion_probabilities"]]
    assert [p["id"] for p in streamed] == body["tokens"] and "completion_probabilities" not in events[-1]


def test_f4_tokens_cached_on_repeated_prompt_and_cache_prompt_false(client: httpx.Client) -> None:
    prompt = f"Note {uuid.uuid4().hex}: the sea is wide and deep, and the ships sail far over the waves."
    first = complete(client, prompt, n_predict=2)
    warm = complete(client, prompt, n_predict=2, cache_prompt=True)
    assert first["tokens_cached"] == 0 and warm["tokens_cached"] >= 16
    assert warm["timings"]["cache_n"] == warm["tokens_cached"]
    assert warm["timings"]["prompt_n"] == warm["tokens_evaluated"] - warm["tokens_cached"]
    cold = complete(client, prompt, n_predict=2, cache_prompt=False)
    assert cold["tokens_cached"] == 0 and cold["content"] == warm["content"]


def test_f4_id_slot(client: httpx.Client) -> None:
    pinned = complete(client, PROMPT, id_slot=2)
    assert pinned["id_slot"] == 2 and pinned["content"] == complete(client, PROMPT)["content"]


def test_f4_stop_word_and_prefill_only(client: httpx.Client) -> None:
    text = complete(client, PROMPT, n_predict=8)["content"]
    word = text[3:6]
    stopped = complete(client, PROMPT, n_predict=8, stop=[word])
    assert stopped["content"] == text[:text.index(word)]
    assert (stopped["stop_type"], stopped["stopping_word"], stopped["stopped_word"]) == ("word", word, True)
    prefill = complete(client, PROMPT, n_predict=0)
    assert (prefill["content"], prefill["tokens_predicted"], prefill["stop_type"]) == ("", 0, "limit")
    assert prefill["tokens_evaluated"] == 5


def test_f4_logit_bias_forms(client: httpx.Client) -> None:
    first = complete(client, PROMPT, n_predict=1, return_tokens=True)["tokens"][0]
    for bias in ([[first, False]], {str(first): -100}, [[" Paris", False]]):
        other = complete(client, PROMPT, n_predict=1, return_tokens=True, logit_bias=bias)
        assert other["tokens"][0] != first, bias
    assert complete(client, PROMPT, n_predict=1, return_tokens=True, logit_bias=[[first, True]])["tokens"] == [first]


def test_f4_priority_header(client: httpx.Client) -> None:
    response = client.post("/completion", json={"prompt": PROMPT, "n_predict": 1}, headers={"X-Priority": "urgent"})
    assert response.status_code == 400 and "X-Priority" in response.json()["error"]["message"]


# ---- /tokenize, /detokenize, /apply-template ----

def test_f4_tokenize_with_pieces_round_trips_through_detokenize(client: httpx.Client) -> None:
    content = "Hello 世界 🦙 <|im_start|>done"
    ids = tokenize(client, content)
    pieces = tokenize(client, content, with_pieces=True)
    assert [p["id"] for p in pieces] == ids
    assert any(isinstance(p["piece"], list) for p in pieces)  # a lone byte of a multi-byte character
    raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert raw.decode() == content
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"content": content, "prompt": content}
    assert len(tokenize(client, "<|im_start|>", parse_special=False)) > 1
    assert tokenize(client, "<|im_start|>") == [1]


def test_f4_apply_template_is_the_chat_prompt(client: httpx.Client) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    prompt = client.post("/apply-template", json={"messages": messages}).json()["prompt"]
    assert prompt.startswith("<|im_start|>system\nBe brief.") and prompt.endswith("<|im_start|>assistant\n")
    counted = client.post("/v1/chat/completions/input_tokens", json={"model": "m", "messages": messages}).json()
    assert counted["input_tokens"] == len(tokenize(client, prompt))
    chat = client.post("/v1/chat/completions", json={**chat_body(), "messages": messages}).json()
    raw = complete(client, prompt, n_predict=6)
    assert raw["content"] == chat["choices"][0]["message"]["content"]


# ---- vLLM's tokenizer routes, as lm-evaluation-harness calls them (issue 26 point 5) ----

def test_tokenizer_info_is_vllms_shape(client: httpx.Client) -> None:
    info = client.get("/tokenizer_info").json()
    assert (info["bos_token"], info["eos_token"]) == ("<|im_start|>", "<|im_end|>")  # SmolLM2's GGUF ids 1, 2
    assert "pad_token" in info and info["model_max_length"] == 1024  # the test engine's context per slot
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast" and info["vocab_size"] == 49152
    assert info["chat_template"].startswith("{%") and "<|im_start|>" in info["chat_template"]
    assert info["added_tokens_decoder"]["2"] == {"content": "<|im_end|>", "lstrip": False, "normalized": False,
                                                 "rstrip": False, "single_word": False, "special": True}


def test_lm_eval_remote_tokenizer_calls(client: httpx.Client) -> None:
    """The calls of lm_eval/utils.py (`check_remote_tokenizer_support`, `RemoteTokenizer`) that
    `local-completions` with `tokenizer_backend=auto` makes, with its bodies and the keys it reads."""
    info = client.get("/tokenizer_info").json()
    assert isinstance(info, dict) and "eos_token" in info  # what auto-detection checks first
    probe = client.post("/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()
    assert isinstance(probe["tokens"], list) and probe["tokens"] == tokenize(client, "test")
    assert client.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()[
        "tokens"] == [2]  # eos_token_id = encode(eos_token)[0]
    ids = client.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": ids}).json()["prompt"] == PROMPT


def test_tokenize_takes_vllms_prompt_and_messages(client: httpx.Client) -> None:
    body = client.post("/tokenize", json={"model": "m", "prompt": PROMPT, "return_token_strs": True}).json()
    assert body["tokens"] == tokenize(client, PROMPT, add_special=True)  # vLLM's prompt default: special tokens on
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    assert body["token_strs"][1] == "Ġcapital"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    prompt = client.post("/apply-template", json={"messages": messages}).json()["prompt"]
    chat = client.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tokenize(client, prompt)
    counted = client.post("/v1/chat/completions/input_tokens", json={"model": "m", "messages": messages}).json()
    assert chat["count"] == counted["input_tokens"]
    both = client.post("/tokenize", json={"prompt": "a", "content": "b"})
    assert both.status_code == 400 and "content and prompt" in both.json()["error"]["message"]


# ---- /infill ----

def test_f4_infill_without_fim_tokens_is_400(client: httpx.Client) -> None:
    response = client.post("/infill", json={"input_prefix": "def f(", "input_suffix": "):\n", "n_predict": 2})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    for name in ("prefix", "suffix", "middle", "<fim_prefix>"):
        assert name in error["message"]


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory: pytest.TempPathFactory, served: ServedModel,
               start_server: Callable[..., ServerThread]) -> Iterator[ServerThread]:
    """A tiny random llama whose tokenizer (SmolLM2's, which has <repo_name> and <file_sep>) gains FIM tokens."""
    from tokenizers import Tokenizer as BackendTokenizer
    from transformers import LlamaConfig

    from mlxcel.config import EngineConfig
    from mlxcel.loading import resolve_model
    from mlxcel.serving.chat_model import start_served_model
    from mlxcel.serving.served_model import RuntimeOptions
    from tests.models.harness import save_tiny_hf

    folder = tmp_path_factory.mktemp("fim-llama")
    backend = BackendTokenizer.from_str(served.tokenizer.backend.to_str())
    backend.add_special_tokens(["<fim_prefix>", "<fim_suffix>", "<fim_middle>"])
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    config = LlamaConfig(vocab_size=backend.get_vocab_size(), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256, tie_word_embeddings=True)
    save_tiny_hf(config, folder)
    model = start_served_model(resolve_model(str(folder)), RuntimeOptions(warmup=False, quantize="off"),
                               EngineConfig(max_num_seqs=1, ctx_size=256))
    yield start_server(model, ServerConfig(port=0))
    model.close(30)


def test_f4_infill_on_a_model_with_fim_tokens(fim_server: ServerThread, tmp_path: Path) -> None:
    body = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n",
            "input_extra": [{"filename": "util.py", "text": "x = 1\n"}], "prompt": "a",
            "n_predict": 3, "temperature": 0, "return_tokens": True}
    with httpx.Client(base_url=fim_server.address, timeout=60) as http:
        reply = http.post("/infill", json=body)
        assert reply.status_code == 200, reply.text
        result = reply.json()
        assert result["prompt"] == ("<repo_name>myproject\n<file_sep>util.py\nx = 1\n<file_sep>filename\n"
                                    "<fim_prefix>def add(a, b):\n    return <fim_suffix>\n<fim_middle>a")
        assert result["tokens_predicted"] == 3 and len(result["tokens"]) == 3 and result["stop"] is True
        again = http.post("/infill", json={**body, "stream": True})
        assert again.text.count("data: ") == 4 and '"stop":true' in again.text


# ---- errors, in llama-server's envelope {"error": {"code", "message", "type"}} ----

@pytest.mark.parametrize(("path", "body", "needle"), [
    ("/completion", {"n_predict": 2}, "prompt"),
    ("/completion", {"prompt": ""}, "empty"),
    ("/completion", {"prompt": [1, 2.5]}, "prompt"),
    ("/completion", {"prompt": [10**9]}, "outside the vocabulary"),
    ("/completion", {"prompt": "x", "n_predict": "3"}, "n_predict"),
    ("/completion", {"prompt": "x", "logit_bias": [[1]]}, "logit_bias.0"),
    ("/completion", {"prompt": "x", "logit_bias": {"1": "big"}}, "logit_bias.1"),
    ("/completion", {"prompt": {"prompt_string": "x", "multimodal_data": ["AAAA"]}}, "multimodal_data"),
    ("/tokenize", {}, "content"),
    ("/detokenize", {"tokens": [1, -4]}, "tokens.1"),
    ("/apply-template", {"messages": []}, "messages"),
    ("/apply-template", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text only"),
    ("/infill", {"input_extra": [{"filename": 3}]}, "input_extra.0.filename"),
])
def test_d1_native_errors(client: httpx.Client, path: str, body: dict[str, Any], needle: str) -> None:
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400 and needle in error["message"]


@pytest.mark.parametrize("path", ["/completion", "/completions", "/tokenize", "/detokenize", "/apply-template",
                                  "/infill"])
def test_d1_native_broken_json_and_content_type(client: httpx.Client, path: str) -> None:
    broken = client.post(path, content=b"{", headers={"Content-Type": "application/json"})
    assert broken.status_code == 400 and broken.json()["error"]["code"] == 400
    plain = client.post(path, content=b"{}", headers={"Content-Type": "text/plain"})
    assert plain.status_code == 415 and plain.json()["error"]["type"] == "invalid_request_error"
