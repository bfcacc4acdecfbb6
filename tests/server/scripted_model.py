"""A tiny llama checkpoint whose greedy output is a script: a thinking, tool-calling "model" for
the chat-intelligence tests (S, R, Q, P, V) through the real server.

The vocabulary is byte-level (256 byte tokens) plus added tokens: chat markers, `<think>` and
`</think>` (plain added tokens, as in Qwen3), `<tool_call>` / `</tool_call>` (special tokens, so
they only reach the parser when the server keeps special tokens), and the script's pieces.

The weights make the model a bigram table: attention and MLP outputs are zero, so the hidden
state is the current token's one-hot embedding, and `lm_head` maps each script token to the
next one. A prompt ending in a newline (the generation prompt `...assistant\\n` or
`...assistant\\n<think>\\n`) therefore continues with

    Let me think.| Paris weather.\\n|</think>|\\n\\n|<tool_call>|{"name": "get_weather", "arguments": |
    {"city": |"Paris"|}}|</tool_call>|<|im_end|>

one piece per token. Any other token is followed by `<|im_end|>`. `write_scripted_model(folder,
call=...)` scripts other call pieces (issue 26: a call to a tool nobody declared), and `opener=` /
`closer=` other markup around them (a Markdown ```json block instead of `<tool_call>` tags).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
PLAIN = ["<think>", "</think>", "\n\n"]
REASONING = ["Let me think.", " Paris weather.\n"]
CALL = ['{"name": "get_weather", "arguments": ', '{"city": ', '"Paris"', "}}"]


def script(call: Sequence[str] = CALL, opener: str = "<tool_call>", closer: str = "</tool_call>") -> list[str]:
    return ["\n", *REASONING, "</think>", "\n\n", opener, *call, closer, "<|im_end|>"]


SCRIPT = script()
REASONING_TEXT = "Let me think. Paris weather."
ARGUMENTS = {"city": "Paris"}

# Qwen3-like: a tools system prompt, reasoning rendered back, `<think>\n` primed while thinking;
# `note` is a free kwarg for observing template-kwargs precedence.
TEMPLATE = (
    "{% if note %}<|im_start|>system\n{{ note }}<|im_end|>\n{% endif %}"
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }} {% endfor %}"
    "Call one as <tool_call>{json}</tool_call>.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def write_scripted_model(folder: Path, *, call: Sequence[str] = CALL, opener: str = "<tool_call>",
                         closer: str = "</tool_call>") -> Path:
    """Write the checkpoint (config.json, model.safetensors, tokenizer files) into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    markup = [piece for piece in (opener, closer) if piece not in SPECIAL]
    vocab = _write_tokenizer(folder, [*markup, *call])
    _write_weights(folder, vocab, script(call, opener, closer))
    return folder


def _write_tokenizer(folder: Path, call: Sequence[str]) -> dict[str, int]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    pieces = [*PLAIN, *REASONING, *call]
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in pieces])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>",
              "chat_template": TEMPLATE, "add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer.get_vocab(with_added_tokens=True)


def _write_weights(folder: Path, vocab: dict[str, int], pieces: Sequence[str],
                   eos: Sequence[str] = ("<|im_end|>",)) -> None:
    """The bigram checkpoint for `pieces`; any other token is followed by `eos[0]` (every one of
    `eos` ends a reply)."""
    from safetensors.torch import save_file

    num_vocab = max(vocab.values()) + 1
    hidden = -(-num_vocab // 8) * 8  # one embedding dimension per token
    heads, head_dim, ffn = 4, hidden // 4, 8
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": num_vocab,
              "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": 1,
              "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": head_dim,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
              "tie_word_embeddings": False, "bos_token_id": None,
              "eos_token_id": vocab[eos[0]] if len(eos) == 1 else [vocab[token] for token in eos]}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {
        "model.embed_tokens.weight": torch.eye(num_vocab, hidden),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": _bigram_head(vocab, num_vocab, hidden, pieces, eos[0]),
        **_silent_layer(hidden, heads * head_dim, ffn),
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))


def _bigram_head(
    vocab: dict[str, int], num_vocab: int, hidden: int, pieces: Sequence[str], fallback: str = "<|im_end|>"
) -> torch.Tensor:
    """[vocab, hidden]: row `next` has weight 1 at the column of each token it follows."""
    ids = [vocab["Ċ" if piece == "\n" else piece] for piece in pieces]  # byte-level "\n" is "Ċ"
    follows = {current: nxt for current, nxt in zip(ids, ids[1:], strict=False)}
    head = torch.zeros(num_vocab, hidden)
    for token in range(num_vocab):
        head[follows.get(token, vocab[fallback]), token] = 1.0
    return head


def _silent_layer(hidden: int, attn: int, ffn: int) -> dict[str, torch.Tensor]:
    """One decoder layer whose attention and MLP add nothing to the residual stream."""
    prefix = "model.layers.0."
    small = torch.Generator().manual_seed(0)
    return {
        prefix + "input_layernorm.weight": torch.ones(hidden),
        prefix + "post_attention_layernorm.weight": torch.ones(hidden),
        prefix + "self_attn.q_proj.weight": torch.randn(attn, hidden, generator=small) * 0.02,
        prefix + "self_attn.k_proj.weight": torch.randn(attn, hidden, generator=small) * 0.02,
        prefix + "self_attn.v_proj.weight": torch.randn(attn, hidden, generator=small) * 0.02,
        prefix + "self_attn.o_proj.weight": torch.zeros(hidden, attn),
        prefix + "mlp.gate_proj.weight": torch.randn(ffn, hidden, generator=small) * 0.02,
        prefix + "mlp.up_proj.weight": torch.randn(ffn, hidden, generator=small) * 0.02,
        prefix + "mlp.down_proj.weight": torch.zeros(hidden, ffn),
    }
