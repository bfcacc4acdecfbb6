"""Tiny checkpoints for the loading tests, built in milliseconds without transformers:
a random llama in Hugging Face layout (config.json, model.safetensors, tokenizer.json) and
small GGUF files written with the `gguf` package's own writer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

EOS = "<|endoftext|>"
TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "torch_dtype": "float32",
}  # fmt: skip


def tiny_tokenizer_json() -> tuple[str, int]:
    """A byte-level BPE whose tokens are the printable ASCII characters plus EOS: (json, vocab size).

    Every token decodes to one printable character, so any generated text is plain ASCII."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = ["\u0120" if b == 32 else chr(b) for b in range(32, 127)]  # byte-level spells a space "Ġ"
    vocab = {ch: i for i, ch in enumerate(chars)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS])
    return tokenizer.to_str(), tokenizer.get_vocab_size()


def tiny_llama_state(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the Hugging Face llama parameter names (embeddings tied)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    layer = {"input_layernorm": (hidden,), "post_attention_layernorm": (hidden,),
             "self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv, hidden),
             "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, hidden),
             "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    for i in range(config["num_hidden_layers"]):
        shapes |= {f"model.layers.{i}.{part}.weight": shape for part, shape in layer.items()}
    return {name: torch.randn(shape, generator=gen) * 0.2 + (1.0 if name.endswith("norm.weight") else 0.0)
            for name, shape in shapes.items()}


def tiny_llama_files(seed: int = 0) -> dict[str, bytes]:
    """The files of a tiny llama repo in Hugging Face layout, as the hub would serve them."""
    from safetensors.torch import save

    tokenizer_json, vocab_size = tiny_tokenizer_json()
    config = {**TINY_LLAMA_CONFIG, "vocab_size": vocab_size, "eos_token_id": vocab_size - 1}
    return {
        "config.json": json.dumps(config, indent=2).encode(),
        "model.safetensors": save(tiny_llama_state(config, seed), metadata={"format": "pt"}),
        "tokenizer.json": tokenizer_json.encode(),
        "tokenizer_config.json": json.dumps({"eos_token": EOS, "bos_token": None}).encode(),
    }


def write_files(folder: Path, files: dict[str, bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Any]],
               metadata: dict[str, int] | None = None) -> Path:
    """A GGUF with `tensors` (name -> (array, GGMLQuantizationType or None)); a quantized array
    is the raw uint8 blocks, whose logical shape the writer works out from the type."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (metadata or {}).items():
        writer.add_uint32(f"{arch}.{key}", value)
    for name, (array, qtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Byte offsets of each type's float16 scales in a block, and the largest |code x sub-scale| of the type (issue 42):
# random bytes there would be NaN, inf or huge, so `random_gguf_blocks` writes scales that bound the weights.
GGUF_SCALE_FIELDS: dict[str, tuple[tuple[int, ...], float]] = {
    "Q5_1": ((0, 2), 31), "Q5_K": ((0, 2), 63 * 31), "Q3_K": ((108,), 32 * 4), "Q2_K": ((80, 82), 15 * 3), "IQ4_NL": ((0,), 127),
    "IQ4_XS": ((0,), 32 * 127), "TQ1_0": ((52,), 2), "TQ2_0": ((64,), 2), "IQ2_XXS": ((0,), 15.5 * 0.25 * 43),
    "IQ2_XS": ((0,), 15.5 * 0.25 * 43), "IQ2_S": ((0,), 15.5 * 0.25 * 43), "IQ3_XXS": ((0,), 15.5 * 0.5 * 62),
    "IQ3_S": ((0,), 31 * 15), "MXFP4": ((), 12),
}  # fmt: skip


def random_gguf_blocks(type_name: str, rows: int, cols: int, seed: int, max_abs: float = 8.0) -> np.ndarray:
    """[rows, bytes a row] of random `type_name` blocks (every bit pattern of the codes) whose float16 scales
    keep |w| under about `max_abs` (MXFP4: exponents that do)."""
    import gguf

    rng = np.random.default_rng(seed)
    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    blocks = rng.integers(0, 256, (rows * cols // block, block_bytes), dtype=np.uint8)
    fields, top = GGUF_SCALE_FIELDS[type_name]
    for at in fields:
        scale = rng.uniform(0.05, 1.0, (len(blocks), 1)) * max_abs / top
        blocks[:, at:at + 2] = scale.astype(np.float16).view(np.uint8)
    if type_name == "MXFP4":  # w = 2^(e - 128) * (up to 12)
        high = int(np.floor(np.log2(max_abs / top))) + 128
        blocks[:, 0] = rng.integers(high - 4, high + 1, len(blocks))
    return blocks.reshape(rows, -1)
