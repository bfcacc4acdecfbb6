"""A tiny random DiffusionGemma checkpoint (spec U) on disk: transformers' own config and weights
(a 2-layer MoE text model and a 1-layer vision tower), the printable-ASCII tokenizer of the
loading tests with Gemma's turn markers and a thinking channel, and a chat template that opens
the thinking channel unless `enable_thinking` is false."""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<pad>", "<start_of_turn>", "<end_of_turn>", "<think>", "</think>", "<boi>", "<eoi>", "<image>"]
CANVAS_LENGTH = 8

CHAT_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}"
    "<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n"
    "{% if enable_thinking is not defined or enable_thinking %}<think>{% endif %}{% endif %}")


def _tokenizer_json() -> tuple[str, dict[str, int]]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from tests.loading.tiny_checkpoint import EOS

    chars = ["\u0120" if b == 32 else chr(b) for b in range(32, 127)]
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(chars)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS, *SPECIALS])
    return tokenizer.to_str(), tokenizer.get_vocab(with_added_tokens=True)


def write_tiny_diffusion_gemma(folder: Path, seed: int = 0) -> Path:
    import torch
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from tests.loading.tiny_checkpoint import EOS

    tokenizer_json, vocab = _tokenizer_json()
    text = {"vocab_size": len(vocab), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "global_head_dim": 16,
            "max_position_embeddings": 512, "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"], "num_experts": 2, "top_k_experts": 1,
            "moe_intermediate_size": 16, "pad_token_id": vocab["<pad>"], "eos_token_id": vocab[EOS],
            "bos_token_id": None}
    vision = {"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "patch_size": 4,
              "pooling_kernel_size": 2, "position_embedding_size": 64}
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=CANVAS_LENGTH,
                                  boi_token_id=vocab["<boi>"], eoi_token_id=vocab["<eoi>"],
                                  image_token_id=vocab["<image>"])
    torch.manual_seed(seed)
    DiffusionGemmaForBlockDiffusion(config).save_pretrained(folder)
    (folder / "tokenizer.json").write_text(tokenizer_json)
    (folder / "preprocessor_config.json").write_text(json.dumps({  # 70 soft tokens an image (Gemma 4's least)
        "image_processor_type": "Gemma4ImageProcessorPil", "patch_size": 4, "pooling_kernel_size": 2,
        "max_soft_tokens": 70}))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": EOS, "bos_token": None, "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}))
    return folder
