"""Tiny MiMo checkpoints (`model_type` "mimo": Qwen2 plus one MTP layer) written to disk, for F10.

The vocabulary and chat template are the scripted model's (scripted_model.py). Two kinds:
- `exact=True`: the main model is a bigram table over a chain of letters and digits (attention and
  MLP outputs are zero, the hidden state is the token's one-hot embedding, `lm_head` maps each chain
  token to the next), and the MTP layer passes the token's embedding through, so it predicts the
  token after next exactly: every draft is accepted.
- `exact=False`: random weights (seeded), the MTP layer's random too except that `input_proj`
  favours the token's embedding: its drafts are right often, not always.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.server.scripted_model import _bigram_head, _write_tokenizer

CHAIN = ["\n", *"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789", "<|im_end|>"]
HEADS = 4


def write_mimo_model(folder: Path, *, exact: bool, seed: int = 0) -> Path:
    """Write config.json, model.safetensors and the tokenizer files of a tiny MiMo into `folder`."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    vocab = _write_tokenizer(folder, [])
    num_vocab = max(vocab.values()) + 1
    hidden = -(-num_vocab // (2 * HEADS)) * (2 * HEADS)  # one embedding dimension per token, even head_dim
    ffn, head_dim = 16, hidden // HEADS
    config = {"model_type": "mimo", "architectures": ["MiMoForCausalLM"], "vocab_size": num_vocab,
              "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": 2, "num_attention_heads": HEADS,
              "num_key_value_heads": HEADS // 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "max_position_embeddings": 4096, "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
              "bos_token_id": None, "eos_token_id": vocab["<|im_end|>"]}
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)
    tensors = {"model.embed_tokens.weight": torch.eye(num_vocab, hidden) if exact else
               torch.randn(num_vocab, hidden, generator=gen),
               "model.norm.weight": torch.ones(hidden),
               "lm_head.weight": _bigram_head(vocab, num_vocab, hidden, CHAIN) if exact else
               torch.randn(num_vocab, hidden, generator=gen) * 0.2}
    for layer in range(2):
        tensors.update(_decoder_layer(f"model.layers.{layer}.", hidden, head_dim, ffn, gen, silent=exact))
    tensors.update(_mtp_layer("model.mtp_layers.0.", hidden, head_dim, ffn, gen, exact=exact))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def _decoder_layer(prefix: str, hidden: int, head_dim: int, ffn: int, gen: torch.Generator, *,
                   silent: bool) -> dict[str, torch.Tensor]:
    """A Qwen2 decoder layer (q/k/v biases); `silent`: its attention and MLP add nothing."""
    q_out, kv_out = HEADS * head_dim, HEADS // 2 * head_dim
    small = lambda *shape: torch.randn(*shape, generator=gen) * 0.02  # noqa: E731
    return {
        prefix + "input_layernorm.weight": torch.ones(hidden),
        prefix + "post_attention_layernorm.weight": torch.ones(hidden),
        prefix + "self_attn.q_proj.weight": small(q_out, hidden), prefix + "self_attn.q_proj.bias": small(q_out),
        prefix + "self_attn.k_proj.weight": small(kv_out, hidden), prefix + "self_attn.k_proj.bias": small(kv_out),
        prefix + "self_attn.v_proj.weight": small(kv_out, hidden), prefix + "self_attn.v_proj.bias": small(kv_out),
        prefix + "self_attn.o_proj.weight": torch.zeros(hidden, q_out) if silent else small(hidden, q_out) * 10,
        prefix + "mlp.gate_proj.weight": small(ffn, hidden),
        prefix + "mlp.up_proj.weight": small(ffn, hidden),
        prefix + "mlp.down_proj.weight": torch.zeros(hidden, ffn) if silent else small(hidden, ffn) * 10,
    }


def _mtp_layer(prefix: str, hidden: int, head_dim: int, ffn: int, gen: torch.Generator, *,
               exact: bool) -> dict[str, torch.Tensor]:
    """MiMo's MTP layer: norms, input_proj over [hidden state, token embedding], a decoder layer, final norm."""
    passthrough = torch.cat((torch.zeros(hidden, hidden), torch.eye(hidden)), dim=1)  # keeps the embedding half
    noise = torch.randn(hidden, 2 * hidden, generator=gen) * 0.02
    return {
        prefix + "token_layernorm.weight": torch.ones(hidden),
        prefix + "hidden_layernorm.weight": torch.ones(hidden),
        prefix + "input_proj.weight": passthrough if exact else passthrough + noise,
        prefix + "final_layernorm.weight": torch.ones(hidden),
        **_decoder_layer(prefix, hidden, head_dim, ffn, gen, silent=exact),
    }
