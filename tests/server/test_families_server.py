"""Issue 40: new families served end to end: a tiny random checkpoint transformers writes, with a real
tokenizer and chat template, through the real HTTP server on port 0 and the OpenAI SDK.

With float weights (`--quantize off`) the greedy text equals transformers' greedy continuation of
the same token ids; with the CPU default rewrite (`--quantize auto`: packed weight-only linears,
the compiled decode step) the model serves and streams the same text as it answers whole."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
import transformers
from tokenizers import Tokenizer

from mlxcel.config import EngineConfig
from mlxcel.loading import resolve_model
from mlxcel.serving.chat_model import start_served_model
from mlxcel.serving.served_model import RuntimeOptions
from tests.loading.tiny_checkpoint import EOS, tiny_tokenizer_json
from tests.models.harness import save_tiny_hf

pytestmark = pytest.mark.slow

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             max_position_embeddings=256, pad_token_id=0)
CONFIGS = {
    "gemma2": lambda vocab: transformers.Gemma2Config(
        **SMALL, num_hidden_layers=4, vocab_size=vocab, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "phi3": lambda vocab: transformers.Phi3Config(
        **SMALL, num_hidden_layers=2, vocab_size=vocab, partial_rotary_factor=0.5),
    "qwen3_moe": lambda vocab: transformers.Qwen3MoeConfig(
        **SMALL, num_hidden_layers=2, vocab_size=vocab, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32),
    "gpt_oss": lambda vocab: transformers.GptOssConfig(
        **{**SMALL, "intermediate_size": 32}, num_hidden_layers=2, vocab_size=vocab, head_dim=16,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=8),
}
PROMPT = "The quick brown fox"
NUM_TOKENS = 12


def _checkpoint(family: str, folder: Path) -> torch.nn.Module:
    tokenizer_json, vocab = tiny_tokenizer_json()
    reference = save_tiny_hf(CONFIGS[family](vocab), folder)
    (folder / "tokenizer.json").write_text(tokenizer_json)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "bos_token": None, "chat_template": TEMPLATE, "add_bos_token": False}))
    return reference


@torch.inference_mode()
def _transformers_text(reference: torch.nn.Module, folder: Path) -> str:
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tokenizer.encode(PROMPT).ids
    start = len(ids)
    for _ in range(NUM_TOKENS):
        logits = reference(torch.tensor([ids])).logits[0, -1]
        logits[tokenizer.token_to_id(EOS)] = float("-inf")
        ids.append(int(logits.argmax()))
    return tokenizer.decode(ids[start:])


@pytest.fixture(params=[("gemma2", "off"), ("phi3", "off"), ("gemma2", "auto"), ("qwen3_moe", "off"),
                        ("gpt_oss", "auto")], ids=lambda p: f"{p[0]}-{p[1]}")
def served(request: pytest.FixtureRequest, tmp_path: Path, start_server) -> Iterator[tuple[str, str, str]]:
    family, quantize = request.param
    reference = _checkpoint(family, tmp_path)
    options = RuntimeOptions(warmup=False, quantize=quantize)
    model = start_served_model(resolve_model(str(tmp_path)), options,
                               EngineConfig(max_num_seqs=2, ctx_size=512, decode_step="eager"))
    server = start_server(model)
    yield server.address, _transformers_text(reference, tmp_path), quantize
    model.close(30)


def test_issue40_a_new_family_serves_completions_and_chat(served: tuple[str, str, str]) -> None:
    address, expected, quantize = served
    client = openai.OpenAI(base_url=f"{address}/v1", api_key="none")
    body = dict(model="m", prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**body).choices[0].text
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(**body, stream=True)
                       if chunk.choices)
    assert whole == streamed and len(whole) == NUM_TOKENS  # one ASCII character a token
    if quantize == "off":
        assert whole == expected
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens >= 1
