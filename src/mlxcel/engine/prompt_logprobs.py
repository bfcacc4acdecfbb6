"""Prompt logprobs (OpenAI legacy `echo` + `logprobs`, vLLM `prompt_logprobs`): each prompt token's
log-probability given the tokens before it, with its rank and the top alternatives.

The runner hands the logits of a request's prompt positions over in blocks (`PROMPT_LOGITS_BLOCK`
rows at a time, so a long chunk never holds [chunk, vocab] at once); position p's row scores
prompt token p + 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mlxcel.types import TokenLogprob

PROMPT_LOGITS_BLOCK = 128  # rows of logits computed at once: 128 x 150k vocab x 4 bytes = 77 MB at most


def prompt_token_logprobs(logits: torch.Tensor, targets: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """logits [n, vocab] (any float dtype, any device); targets: the n tokens they predict."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(list(targets), dtype=torch.long, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, index)  # [n, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # ties share the better rank, as vLLM's
    top_values, top_ids = torch.topk(logprobs, num_top, dim=-1) if num_top > 0 else (None, None)
    chosen_l, ranks_l = chosen.squeeze(1).tolist(), ranks.tolist()
    tops = (list(zip(top_ids.tolist(), top_values.tolist())) if top_ids is not None  # type: ignore[union-attr]
            else [([], [])] * len(chosen_l))
    return [TokenLogprob(token_id=t, logprob=lp, top=tuple(zip(ids, values)), rank=rank)
            for t, lp, rank, (ids, values) in zip(targets, chosen_l, ranks_l, tops)]
