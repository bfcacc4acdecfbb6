"""Running a family's Model the ways the engine does: uncached, batched, and over a paged KV cache.

Also builds tiny random checkpoints of each family in HF layout (through transformers itself)
and, from those, tiny GGUF files written the way llama.cpp's converter writes them.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mlxcel.engine.kv.tensors import KVCache
from mlxcel.layers.attention import AttentionContext, SequenceSlice


def uncached_logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """[T, vocab] for one prompt in one step, no KV cache."""
    return batch_uncached_logits(model, [ids])[0]


@torch.inference_mode()
def uncached_hidden(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """[T, hidden] for one prompt, no KV cache (for comparing logits at a few rows only)."""
    device = next(model.parameters()).device
    ctx = AttentionContext([SequenceSlice(0, len(ids), len(ids))], None, device)
    return model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), ctx)


@torch.inference_mode()
def batch_uncached_logits(model: nn.Module, prompts: list[list[int]]) -> list[torch.Tensor]:
    """All prompts as one flat step (the runner's layout), split back per prompt."""
    ids, pos, slices = [], [], []
    for prompt in prompts:
        slices.append(SequenceSlice(q_start=len(ids), q_len=len(prompt), kv_len=len(prompt)))
        ids.extend(prompt)
        pos.extend(range(len(prompt)))
    device = next(model.parameters()).device
    hidden = model(torch.tensor(ids, device=device), torch.tensor(pos, device=device),
                   AttentionContext(slices, None, device))
    logits = model.compute_logits(hidden)
    return [logits[s.q_start:s.q_start + s.q_len] for s in slices]


class PagedSequences:
    """Sequences over a paged KVCache whose block ids are handed out in shuffled order."""

    def __init__(self, model: nn.Module, num_blocks: int = 96, block_size: int = 4) -> None:
        param = next(model.parameters())
        args = model.args
        self.model, self.device = model, param.device
        shapes = getattr(args, "kv_layer_shapes", None)  # Gemma 4: per-layer widths, KV-shared layers keep none
        self.kv = KVCache(len(shapes) if shapes else args.num_hidden_layers, num_blocks, block_size, args.kv_heads,
                          args.dim_per_head, param.dtype, param.device,
                          values_are_keys=getattr(args, "kv_values_are_keys", False), layer_shapes=shapes)
        self.free = list(range(num_blocks))
        random.Random(0).shuffle(self.free)  # non-contiguous tables exercise the slot mapping
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    @torch.inference_mode()
    def step(self, feeds: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Append each sequence's new tokens in one step; returns their logits [len, vocab]."""
        ids: list[int] = []
        pos: list[int] = []
        slices = [self._slice(seq_id, tokens, len(ids), ids, pos) for seq_id, tokens in feeds.items()]
        ctx = self._context(list(feeds), slices)
        hidden = self.model(torch.tensor(ids, device=self.device), torch.tensor(pos, device=self.device), ctx)
        logits = self.model.compute_logits(hidden)
        return {seq_id: logits[s.q_start:s.q_start + s.q_len] for seq_id, s in zip(feeds, slices)}

    def _context(self, seq_ids: list[int], slices: list[SequenceSlice]) -> AttentionContext:
        return AttentionContext(slices, self.kv, self.device)

    def _slice(self, seq_id: int, tokens: list[int], q_start: int, ids: list[int], pos: list[int]) -> SequenceSlice:
        start = self.lengths.get(seq_id, 0)
        stop = start + len(tokens)
        table = self.tables.setdefault(seq_id, [])
        while len(table) * self.kv.block_size < stop:
            table.append(self.free.pop())
        self.lengths[seq_id] = stop
        ids.extend(tokens)
        pos.extend(range(start, stop))
        return SequenceSlice(q_start=q_start, q_len=len(tokens), kv_len=stop, block_table=tuple(table))


def cached_logits(model: nn.Module, ids: list[int], prefill_chunks: tuple[int, ...],
                  sequences: type[PagedSequences] = PagedSequences) -> torch.Tensor:
    """Prefill in the given chunk sizes, then decode the rest one token a step: [T, vocab]."""
    seqs = sequences(model)
    parts, start = [], 0
    for size in prefill_chunks:
        parts.append(seqs.step({0: ids[start:start + size]})[0])
        start += size
    for token in ids[start:]:
        parts.append(seqs.step({0: [token]})[0])
    return torch.cat(parts)


def lockstep_cached_logits(model: nn.Module, prompts: list[list[int]], prefill_len: int,
                           sequences: type[PagedSequences] = PagedSequences) -> list[torch.Tensor]:
    """Every prompt's first `prefill_len` tokens in one mixed step, then all decode together."""
    seqs = sequences(model)
    out = {i: [logits] for i, logits in seqs.step({i: p[:prefill_len] for i, p in enumerate(prompts)}).items()}
    for t in range(prefill_len, max(len(p) for p in prompts)):
        live = {i: [p[t]] for i, p in enumerate(prompts) if t < len(p)}
        for i, logits in seqs.step(live).items():
            out[i].append(logits)
    return [torch.cat(out[i]) for i in range(len(prompts))]


def greedy(model: nn.Module, prompt: list[int], num_tokens: int,
           sequences: type[PagedSequences] = PagedSequences) -> list[int]:
    """Greedy continuation through the paged cache (prefill once, then one token a step)."""
    seqs = sequences(model, num_blocks=(len(prompt) + num_tokens) // 4 + 2)
    token = int(seqs.step({0: prompt})[0][-1].argmax())
    generated = [token]
    while len(generated) < num_tokens:
        token = int(seqs.step({0: [token]})[0][-1].argmax())
        generated.append(token)
    return generated


# ---- tiny checkpoints -------------------------------------------------------------------------

def save_tiny_hf(config: Any, folder: Path, seed: int = 0, model_type: str | None = None) -> nn.Module:
    """A transformers model with random weights (biases and norms too), saved in HF layout;
    `model_type` renames the saved config's type (Kimi K2 ships DeepSeek-V3's architecture as "kimi_k2")."""
    import json

    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # larger than the init keeps logits far from ties
            p.normal_(0.0, 0.2)
        for name, buffer in model.named_buffers():  # DeepSeek-style routers' selection bias is a buffer
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.2)
            if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale (1 at init)
                buffer.uniform_(0.5, 1.5)
    model.eval().save_pretrained(folder)
    if model_type is not None and model_type != config.model_type:
        saved = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**saved, "model_type": model_type}))
    return model


def llama3_freq_factors(scaling: dict[str, Any], head_dim: int, theta: float) -> np.ndarray:
    """`rope_freqs` as llama.cpp's converter computes it for rope_type llama3."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_tiny_gguf(model: nn.Module, arch: str, path: Path, quant_type: str | None = None) -> Path:
    """The HF model as a GGUF laid out as llama.cpp's converter writes `arch`: F32, or with its
    matrices in `quant_type` (e.g. "Q4_0"; norms and vectors stay F32, as the converter keeps them)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    _write_gguf_metadata(writer, model.config, arch)
    for name, array in _gguf_tensors(model, arch):
        if quant_type is not None and array.ndim >= 2:  # expert stacks [E, N, K] too
            qtype = gguf.GGMLQuantizationType[quant_type]
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_gguf_metadata(writer: Any, cfg: Any, arch: str) -> None:
    import gguf

    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    head_dim = head_dim_of(cfg)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    if arch == "gemma3":
        writer.add_sliding_window(cfg.sliding_window)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if getattr(cfg, "num_experts", None):  # transformers 5 names it num_local_experts too
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def _gguf_tensors(model: nn.Module, arch: str) -> list[tuple[str, np.ndarray]]:
    from mlxcel.loading.checkpoint import GGUF_ARCHITECTURES, GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES, family_module

    module = family_module(GGUF_ARCHITECTURES.get(arch, arch), kind="GGUF architecture")
    layer_names = {hf: g for g, hf in {**GGUF_LAYER_NAMES, **getattr(module, "GGUF_LAYER_NAMES", {})}.items()}
    global_names = {hf: g for g, hf in GGUF_GLOBAL_NAMES.items()}
    cfg = model.config
    out = []
    for name, tensor in _split_expert_stacks(model.state_dict()).items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stem, kind = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, idx, part = stem.split(".", 3)
            gguf_name = f"blk.{idx}.{layer_names[part]}.{kind}"
        else:
            gguf_name = f"{global_names[stem]}.{kind}"
        out.append((gguf_name, _to_gguf_layout(name, tensor.float().numpy(), cfg, arch)))
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "llama3":
        out.append(("rope_freqs.weight", llama3_freq_factors(rope, head_dim_of(cfg), rope["rope_theta"])))
    return out


def _split_expert_stacks(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's stacked experts as llama.cpp's converter writes them: gate, up [E, I, H] and
    down [E, H, I] apart, under names the family's GGUF_LAYER_NAMES map (ffn_*_exps)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            out[f"{name[:-len('gate_up_proj')]}gate_proj.weight"] = gate
            out[f"{name[:-len('gate_up_proj')]}up_proj.weight"] = up
        elif name.endswith("experts.down_proj"):
            out[f"{name}.weight"] = tensor
        else:
            out[name] = tensor
    return out


def _to_gguf_layout(name: str, array: np.ndarray, cfg: Any, arch: str) -> np.ndarray:
    if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
        # llama.cpp interleaves each head's rotary halves (its `permute`).
        return array.reshape(heads, 2, array.shape[0] // heads // 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)
    if arch == "gemma3" and name.endswith("norm.weight"):
        return array + 1.0  # the converter stores Gemma norms as (1 + w)
    return array


def head_dim_of(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


# ---- prompts for the real checkpoints ----------------------------------------------------------

_PARAGRAPH = ("The river bends twice before it reaches the old mill, where the water slows and "
              "the village children count the fish that rest in the shade of the wheel. ")
REAL_TEXT_PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Paris est la capitale de la France. Berlin est la capitale de",
    "Emoji 🎉 and numbers 3.14159, 2718 and 1,000,000; 日本語のテキストも少し。",
]


def packaged_gguf(name: str) -> Path:
    """A GGUF that ships in slices across packages (loading/packaged.py), joined once; the test is
    skipped where its packages are not installed (they are kept out of the default setup)."""
    import importlib.util

    import pytest

    from mlxcel.loading.packaged import SPLIT_GGUFS, resolve_packaged

    if importlib.util.find_spec(SPLIT_GGUFS[name].modules[0]) is None:
        pytest.skip(f"{name} is not installed ({SPLIT_GGUFS[name].install_command()})")
    return resolve_packaged(name)


def real_prompts(name: str, tokenizer: Any) -> list[list[int]]:
    """Five prompts as ids from the reference tokenizer, so both sides see the same tokens."""
    ids = [tokenizer(text).input_ids for text in REAL_TEXT_PROMPTS]
    if name == "smollm2":  # the instruct model's own chat format
        chat = [{"role": "user", "content": "Name three primary colours."}]
        ids.append(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))
    else:  # longer than the 512-token sliding window, so the window takes effect
        ids.append(tokenizer(_PARAGRAPH * 20).input_ids)
    return ids


def compared_positions(length: int) -> torch.Tensor:
    """Every position of a short prompt; for a long one every 16th and the last 32."""
    if length <= 64:
        return torch.arange(length)
    return torch.unique(torch.cat([torch.arange(0, length, 16), torch.arange(length - 32, length)]))
