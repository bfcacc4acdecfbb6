"""Running a hybrid (recurrent + attention) family the ways the engine does, with its recurrent
states carried explicitly: a paged KV cache for its attention layers and a `StateTensors` pool
(layers/recurrent.py) with one slot a sequence for its recurrent layers."""

from __future__ import annotations

import torch
from torch import nn

from mlxcel.layers.attention import AttentionContext
from mlxcel.layers.recurrent import RecurrentStates, StateTensors, state_specs

from .harness import PagedSequences


class HybridSequences(PagedSequences):
    """PagedSequences whose steps also read and write each sequence's recurrent state slot."""

    def __init__(self, model: nn.Module, num_blocks: int = 96, block_size: int = 4, num_slots: int = 8) -> None:
        super().__init__(model, num_blocks, block_size)
        param = next(model.parameters())
        self.pool = StateTensors(state_specs(model), num_slots, param.dtype, param.device)
        self.slots: dict[int, int] = {}

    @torch.inference_mode()
    def step(self, feeds: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        ids: list[int] = []
        pos: list[int] = []
        slices = [self._slice(seq_id, tokens, len(ids), ids, pos) for seq_id, tokens in feeds.items()]
        for seq_id in feeds:
            if seq_id not in self.slots:  # slot 0 is the scratch slot
                self.slots[seq_id] = len(self.slots) + 1
                self.pool.clear([self.slots[seq_id]])
        slots = [self.slots[seq_id] for seq_id in feeds]
        states = RecurrentStates(self.pool, [s.q_start for s in slices], [s.q_len for s in slices], slots, slots)
        ctx = AttentionContext(slices, self.kv, self.device, states=states)
        hidden = self.model(torch.tensor(ids, device=self.device), torch.tensor(pos, device=self.device), ctx)
        logits = self.model.compute_logits(hidden)
        return {seq_id: logits[s.q_start:s.q_start + s.q_len] for seq_id, s in zip(feeds, slices)}


def cached_logits(model: nn.Module, ids: list[int], prefill_chunks: tuple[int, ...]) -> torch.Tensor:
    """Prefill in the given chunk sizes, then one token a step: [T, vocab]."""
    seqs = HybridSequences(model)
    parts, start = [], 0
    for size in prefill_chunks:
        parts.append(seqs.step({0: ids[start:start + size]})[0])
        start += size
    for token in ids[start:]:
        parts.append(seqs.step({0: [token]})[0])
    return torch.cat(parts)


def lockstep_cached_logits(model: nn.Module, prompts: list[list[int]], prefill_len: int) -> list[torch.Tensor]:
    """Every prompt's first `prefill_len` tokens in one mixed step, then all one token a step together."""
    seqs = HybridSequences(model)
    out = {i: [logits] for i, logits in seqs.step({i: p[:prefill_len] for i, p in enumerate(prompts)}).items()}
    for t in range(prefill_len, max(len(p) for p in prompts)):
        live = {i: [p[t]] for i, p in enumerate(prompts) if t < len(p)}
        for i, logits in seqs.step(live).items():
            out[i].append(logits)
    return [torch.cat(out[i]) for i in range(len(prompts))]


def greedy(model: nn.Module, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation: the prompt in one step, then one token a step."""
    seqs = HybridSequences(model, num_blocks=(len(prompt) + num_tokens) // 4 + 2)
    token = int(seqs.step({0: prompt})[0][-1].argmax())
    generated = [token]
    while len(generated) < num_tokens:
        token = int(seqs.step({0: [token]})[0][-1].argmax())
        generated.append(token)
    return generated
