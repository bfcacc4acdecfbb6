"""A tiny random llama whose embedding has more rows than its tokenizer has tokens (issue 44).

Real checkpoints are padded so (Qwen2.5: 151,936 rows for 151,665 tokens); a model can rank or emit
those ids. Here the tokenizer has 96 tokens (the printable ASCII characters and EOS) and the model 128
rows. Its embeddings are one-hot and its layers small random weights, so the output is a bigram the
tests can rely on: after any real token comes the padded id PAD_ID, after a padded id comes "b". A
greedy answer is PAD_ID, "b", PAD_ID, "b", ...: text "bbb...", every other token an id without text.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.loading.tiny_checkpoint import EOS, TINY_LLAMA_CONFIG, tiny_llama_state, tiny_tokenizer_json

NUM_ROWS = 128  # the model's vocabulary (embedding rows); the tokenizer has 96 tokens
PAD_ID = 100  # the padded id the model emits after every real token
B_ID = ord("b") - 32  # the tiny tokenizer's id of "b" (its tokens are the characters 32..126)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}: {{ m.content }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}")


def write_padded_vocab_model(folder: Path) -> Path:
    """The checkpoint's files (config.json, model.safetensors, tokenizer.json, tokenizer_config.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer_json, num_tokens = tiny_tokenizer_json()
    eos_id = num_tokens - 1
    config = {**TINY_LLAMA_CONFIG, "vocab_size": NUM_ROWS, "hidden_size": NUM_ROWS, "eos_token_id": eos_id,
              "tie_word_embeddings": False}
    state = {name: value * 0.1 if "proj" in name else value for name, value in tiny_llama_state(config).items()}
    state["model.embed_tokens.weight"] = torch.eye(NUM_ROWS)
    state["lm_head.weight"] = _bigram_head(num_tokens)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "tokenizer.json").write_text(tokenizer_json)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "bos_token": None,
                                                              "chat_template": TEMPLATE}))
    return folder


def _bigram_head(num_tokens: int) -> torch.Tensor:
    """[rows, hidden]: the row of the next token has a 1 at the column of the token before it."""
    head = torch.zeros(NUM_ROWS, NUM_ROWS)
    for token in range(NUM_ROWS):
        head[PAD_ID if token < num_tokens else B_ID, token] = 1.0
    return head
