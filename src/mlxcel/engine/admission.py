"""Request memory admission (spec O): a request's KV memory is estimated before any forward pass.

A request needs KV blocks for its whole prompt and its planned output (`max_tokens`, or the
rest of the slot's context when unset), and draft KV for the same tokens when a draft model
keeps its own cache (`draft_bytes_per_token`). The budget is what the KV pool holds;
`MLXCEL_REQUEST_MEMORY_BUDGET` may only lower it. A request over the budget could never finish
without being preempted forever, so it is refused at submit, before it reaches the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxcel.types import RequestMemoryError


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """The most KV bytes one request may need, and how a request's need is counted."""

    block_size: int
    bytes_per_token: int  # K + V over every layer
    budget_bytes: int
    draft_bytes_per_token: int = 0  # a draft model's own KV (speculative decoding); 0 = none
    max_live_tokens: int = 0  # --max-kv-size window plus its slack; 0 = no window
    state_bytes: int = 0  # a hybrid model's recurrent state of one sequence (issue 41), held beside its KV

    @classmethod
    def of(cls, num_pool_blocks: int, block_size: int, bytes_per_token: int, lowered_to: int = 0,
           *, max_live_tokens: int = 0, state_bytes: int = 0) -> MemoryBudget:
        """The pool's capacity (KV blocks, plus one sequence's recurrent state), lowered to `lowered_to` bytes
        when that is smaller (never raised)."""
        pool_bytes = num_pool_blocks * block_size * bytes_per_token + state_bytes
        budget = min(pool_bytes, lowered_to) if lowered_to else pool_bytes
        return cls(block_size, bytes_per_token, budget, max_live_tokens=max_live_tokens, state_bytes=state_bytes)

    def num_blocks(self, num_prompt_tokens: int, num_output_tokens: int) -> int:
        """KV blocks for the prompt and the planned output (a sliding window caps the live part)."""
        num_tokens = num_prompt_tokens + num_output_tokens
        if self.max_live_tokens:
            num_tokens = min(num_tokens, self.max_live_tokens)
        return -(-num_tokens // self.block_size)

    @property
    def block_bytes(self) -> int:
        """One KV block's bytes: the least any request needs, so the smallest budget that serves anything."""
        return self.block_size * (self.bytes_per_token + self.draft_bytes_per_token)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt plus output) whose KV fits the budget: whole blocks only."""
        return max(self.budget_bytes - self.state_bytes, 0) // self.block_bytes * self.block_size

    def estimate_bytes(self, num_prompt_tokens: int, num_output_tokens: int) -> int:
        tokens = self.num_blocks(num_prompt_tokens, num_output_tokens) * self.block_size
        return tokens * (self.bytes_per_token + self.draft_bytes_per_token) + self.state_bytes

    def check(self, request_id: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """Raise RequestMemoryError when the request's estimate is over the budget."""
        estimate = self.estimate_bytes(num_prompt_tokens, num_output_tokens)
        if estimate > self.budget_bytes:
            raise RequestMemoryError(request_id, estimate, self.budget_bytes)
