"""Issue 41: a Qwen3.5 hybrid (Gated DeltaNet + gated attention) served end to end: a tiny random
`qwen3_5` checkpoint (the vision-language layout: the text model under `model.language_model`, a
`text_config`) with a real tokenizer carrying `<think>` / `</think>`, through the real HTTP server on
port 0 and the OpenAI SDK: completions equal transformers' greedy text, streamed equals whole, a repeat
resumes from a state snapshot, and a chat turn whose template opens `<think>` answers as reasoning."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from mlxcel.config import EngineConfig
from mlxcel.loading import resolve_model
from mlxcel.serving.chat_model import start_served_model
from mlxcel.serving.served_model import RuntimeOptions
from mlxcel.server.config import ServerConfig
from tests.loading.tiny_checkpoint import EOS, tiny_tokenizer_json
from tests.models.harness import save_tiny_hf

pytestmark = pytest.mark.slow

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant><think>\n"
PROMPT = "The quick brown fox jumps over the lazy dog"  # 43 tokens: two whole blocks of 16
NUM_TOKENS = 12


def _checkpoint(folder: Path) -> tuple[torch.nn.Module, Tokenizer]:
    tokenizer = Tokenizer.from_str(tiny_tokenizer_json()[0])
    tokenizer.add_tokens(["<think>", "</think>"])
    vocab = tokenizer.get_vocab_size()
    text = transformers.Qwen3_5TextConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=vocab, max_position_embeddings=512, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"])
    reference = save_tiny_hf(text, folder)
    # As the Qwen3.5 release writes it: a qwen3_5 config around the text config, the text weights nested.
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": config,
        "vision_config": {"depth": 1}, "tie_word_embeddings": False}))
    weights = load_file(str(folder / "model.safetensors"))
    nested = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
              for k, v in weights.items()}
    nested["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)  # a vision tower the server leaves out
    save_file(nested, str(folder / "model.safetensors"))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "bos_token": None, "chat_template": TEMPLATE, "add_bos_token": False}))
    return reference, tokenizer


@torch.inference_mode()
def _transformers_text(reference: torch.nn.Module, tokenizer: Tokenizer) -> str:
    ids = tokenizer.encode(PROMPT).ids
    start = len(ids)
    banned = [tokenizer.token_to_id(t) for t in (EOS, "<think>", "</think>")]
    for _ in range(NUM_TOKENS):
        logits = reference(torch.tensor([ids])).logits[0, -1]
        logits[banned] = float("-inf")
        ids.append(int(logits.argmax()))
    return tokenizer.decode(ids[start:])


@pytest.fixture
def served(tmp_path: Path, start_server) -> Iterator[tuple[str, str, object]]:
    reference, tokenizer = _checkpoint(tmp_path)
    model = start_served_model(resolve_model(str(tmp_path)), RuntimeOptions(warmup=False, quantize="off"),
                               EngineConfig(max_num_seqs=2, ctx_size=1024, decode_step="eager"))
    server = start_server(model, ServerConfig(port=0, endpoint_metrics=True, endpoint_props=True))
    yield server.address, _transformers_text(reference, tokenizer), tokenizer
    model.close(30)


def test_issue41_qwen3_5_serves_completions_and_chat_with_reasoning(served) -> None:
    address, expected, tokenizer = served
    client = openai.OpenAI(base_url=f"{address}/v1", api_key="none")
    bias = {str(tokenizer.token_to_id(t)): -100 for t in ("<think>", "</think>")}
    body = dict(model="m", prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0, logit_bias=bias,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**body)
    assert whole.choices[0].text == expected
    streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices)
    assert streamed == expected
    # The prompt's whole blocks were cached with a state snapshot: a repeat resumes and gives the same text.
    again = client.completions.create(**body)
    assert again.choices[0].text == expected
    assert again.usage.prompt_tokens_details.cached_tokens == (again.usage.prompt_tokens - 1) // 16 * 16 > 0
    # The recurrent-state pool as /props, /metrics and /slots show it (snapshots: the prompt's 2 blocks at least).
    pool = httpx.get(f"{address}/props", timeout=30).json()["recurrent_state"]
    assert pool["bytes"] == pool["bytes_per_sequence"] * pool["slots"] > 0 and pool["snapshots"] >= 1
    assert pool["resumed"] >= 1
    metrics = httpx.get(f"{address}/metrics", timeout=30).text
    assert f"mlxcel_recurrent_state_bytes {float(pool['bytes'])}" in metrics
    slots = httpx.get(f"{address}/slots", timeout=30).json()
    assert len(slots) == 2 and all(s["recurrent_state"] == {"bytes": pool["bytes_per_sequence"], "snapshots": 0}
                                   for s in slots)  # idle slots: their state is held, no request's snapshots
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0, logit_bias={str(tokenizer.token_to_id("</think>")): -100})
    message = chat.choices[0].message
    # The template opened <think> and the model never closed it: all of the reply is reasoning.
    assert getattr(message, "reasoning_content", None) and not message.content
    assert chat.usage.completion_tokens == 6
