"""Full-model drafting (B1): a small model with the target's tokenizer drafts greedily.

The drafter keeps its own paged KV (a block pool, block tables and prefix caching like the
target's, so a shared prompt is computed once) and a shadow copy of each request's tokens.
Each round it rolls its KV back to the longest prefix it shares with the request's tokens
(rejected drafts drop out), catches up on the tokens accepted since (rows of one decode step,
`Runner.extend`; the first round prefills the prompt), then decodes `max_len` tokens greedily. Its state goes when the request does.
It runs on the engine's thread, through the same Runner and decode step as the target.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mlxcel.engine.decode_step import DecodeStep
from mlxcel.engine.kv.blocks import BlockPool
from mlxcel.engine.kv.prefix import KVCacheManager
from mlxcel.engine.runner import Runner
from mlxcel.engine.scheduler import ScheduledSeq, SchedulerOutput
from mlxcel.engine.scheduler import Sequence as EngineSequence

if TYPE_CHECKING:
    from mlxcel.engine.loop import ModelShape

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _DraftState:
    shadow: EngineSequence  # the request's tokens plus the last draft; num_computed_tokens = draft KV
    num_known: int = 0  # request tokens at the last round (they match the shadow's)
    is_admitted: bool = False


class ModelDrafter:
    """Greedy drafts from a small model; owns its KV pool and per-request draft KV."""

    kind = "full-model"

    def __init__(self, model: torch.nn.Module, shape: ModelShape, *, num_blocks: int, block_size: int,
                 device: torch.device | str, dtype: torch.dtype, mode: str, max_rows: int,
                 kv_types: tuple[str, str] | None = None, enable_prefix_caching: bool = True) -> None:
        k_type, v_type = kv_types or (None, None)
        self.kv_cache = shape.kv_cache(num_blocks, block_size, dtype, device, k_type, v_type)
        self.kv = KVCacheManager(BlockPool(num_blocks, block_size, enable_caching=enable_prefix_caching),
                                 enable_prefix_caching=enable_prefix_caching)
        step = DecodeStep(model, self.kv_cache, device, mode=mode, max_rows=max_rows,
                          max_positions=shape.context_length)
        self.runner = Runner(model, self.kv_cache, self.kv, device, step)
        self.max_positions = shape.context_length
        self._states: dict[str, _DraftState] = {}

    def warm(self) -> float:
        return self.runner.decode_step.warm()

    @property
    def num_requests(self) -> int:
        return len(self._states)

    def propose(self, seq: EngineSequence, max_len: int) -> tuple[int, ...]:
        max_len = min(max_len, self.max_positions - seq.num_tokens)  # the drafter's own context
        if max_len < 1:
            return ()
        state = self._states.get(seq.request_id) or self._new_state(seq)
        self._roll_back(state, seq.token_ids)
        logits = self._forward(state, seq.token_ids)
        draft: list[int] = []
        while logits is not None:
            draft.append(int(logits[0].argmax()))
            state.shadow.token_ids.append(draft[-1])
            if len(draft) == max_len:
                break
            logits = self._forward(state, seq.token_ids)
        return tuple(draft)

    def free(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.kv.free(request_id, num_computed_tokens=state.shadow.num_computed_tokens)

    def _new_state(self, seq: EngineSequence) -> _DraftState:
        shadow = EngineSequence(request=seq.request, token_ids=[], num_prompt_tokens=seq.num_prompt_tokens)
        state = _DraftState(shadow)
        self._states[seq.request_id] = state
        return state

    def _roll_back(self, state: _DraftState, known: list[int]) -> None:
        """Keep the draft KV of the longest common prefix of the shadow and the request's tokens."""
        shadow = state.shadow
        common = state.num_known
        limit = min(shadow.num_computed_tokens, len(known))
        while common < limit and shadow.token_ids[common] == known[common]:
            common += 1
        shadow.token_ids = list(known)
        shadow.num_computed_tokens = min(common, shadow.num_computed_tokens)
        state.num_known = len(known)

    def _forward(self, state: _DraftState, known: list[int]) -> torch.Tensor | None:
        """Compute the shadow's uncomputed positions; the last one's logits [1, vocab] (None: no KV room)."""
        shadow = state.shadow
        if not self._allocate(state, known):
            return None
        num_new = shadow.num_tokens - shadow.num_computed_tokens
        if shadow.num_computed_tokens and num_new <= self.runner.decode_step.max_rows:
            # Catching up on the accepted tokens: rows of one decode step (native, compiled or a
            # CUDA graph), not a prefill chunk through the eager forward.
            logits = self.runner.extend(shadow, num_new)
        else:
            logits = self.runner.execute(SchedulerOutput(scheduled=[ScheduledSeq(shadow, num_new)])).logits
        shadow.num_computed_tokens += num_new
        return logits

    def _allocate(self, state: _DraftState, known: list[int]) -> bool:
        # Only the request's known tokens are hashed (donated): draft tokens may be rolled back.
        shadow, rid = state.shadow, state.shadow.request_id
        if not state.is_admitted:  # the first round: reuse a cached prefix of the prompt
            cached, shadow.num_computed_tokens = self.kv.find_cached_prefix(
                known, cache_prompt=shadow.request.cache_prompt)
            state.is_admitted = self.kv.allocate(
                rid, known, shadow.num_computed_tokens, shadow.num_tokens - shadow.num_computed_tokens, cached,
                cache_prompt=shadow.request.cache_prompt) is not None
            return state.is_admitted
        num_new = shadow.num_tokens - shadow.num_computed_tokens
        return self.kv.allocate(rid, known, shadow.num_computed_tokens, num_new) is not None
