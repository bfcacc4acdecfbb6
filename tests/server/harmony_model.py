"""A tiny checkpoint whose greedy reply is gpt-oss harmony text: reasoning, then a tool call.

Built like scripted_model.py (a bigram table over a byte-level vocabulary with added tokens).
A bigram model cannot write `<|channel|>` twice and go on differently each time, so the two
message headers are each one added token holding the whole header; the decoded text is what
gpt-oss writes, token for token of text:

    <|channel|>analysis<|message|>|The user wants the weather.| Call get_weather.|<|end|>|
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>|
    {"city": |"Paris"|}|<|call|>

The generation prompt ends in `<|start|>assistant` (its last token is the byte `t`), which the
script follows. `<|return|>` and `<|call|>` end a reply, as gpt-oss's generation config says;
the lone markers `<|channel|>`, `<|message|>`, `<|end|>` are in the vocabulary too, so the server
finds harmony's reasoning markers there, as it does in gpt-oss's.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.server.scripted_model import _write_weights

MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
           "<|endoftext|>"]
ANALYSIS = "<|channel|>analysis<|message|>"
CALL_HEADER = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
REASONING = ["The user wants the weather.", " Call get_weather."]
ARGUMENT_PIECES = ['{"city": ', '"Paris"', "}"]
SCRIPT = ["t", ANALYSIS, *REASONING, "<|end|>", CALL_HEADER, *ARGUMENT_PIECES, "<|call|>"]
REASONING_TEXT = "The user wants the weather. Call get_weather."
ARGUMENTS = {"city": "Paris"}

# gpt-oss's shape, cut down: tools in a developer message, calls rendered back on the commentary channel.
TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|># Tools\n\nnamespace functions {\n"
    "{% for t in tools %}type {{ t.function.name }} = (_: any) => any;\n{% endfor %}} // namespace functions"
    "<|end|>{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ c.function.name }} <|constrain|>json<|message|>"
    "{{ c.function.arguments }}<|call|>{% endfor %}"
    "{% elif m.role == 'tool' %}<|start|>functions.{{ m.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def write_harmony_model(folder: Path) -> Path:
    """Write the checkpoint (config.json, model.safetensors, tokenizer files) into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = _write_tokenizer(folder)
    _write_weights(folder, vocab, SCRIPT, eos=("<|return|>", "<|call|>"))
    return folder


def _write_tokenizer(folder: Path) -> dict[str, int]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    special = [*MARKERS, ANALYSIS, CALL_HEADER]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in [*REASONING, *ARGUMENT_PIECES]])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|return|>", "bos_token": None, "pad_token": "<|endoftext|>",
              "chat_template": TEMPLATE, "add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer.get_vocab(with_added_tokens=True)
