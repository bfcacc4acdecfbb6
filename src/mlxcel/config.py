"""Small frozen configuration records, composed downward; derived values are computed, not stored."""

from __future__ import annotations

from dataclasses import dataclass

# KV cache element types, as llama-server spells them (--cache-type-k / --cache-type-v).
CACHE_TYPES = ("f32", "bf16", "f16")
DECODE_STEPS = ("auto", "compile", "cuda-graph", "eager")

MAX_KV_SIZE_MIN = 64
MAX_KV_SIZE_MAX = 2_147_483_647


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine batches and caches (llama-server flag names in comments)."""

    max_num_seqs: int = 4  # --parallel
    ctx_size: int = 0  # --ctx-size: total tokens over all slots; 0 = model context per slot
    max_num_batched_tokens: int = 512  # --ubatch-size: tokens one step may compute
    block_size: int = 16
    max_queue_depth: int = 64  # --max-queue-depth
    enable_prefix_caching: bool = True  # --no-prompt-cache / --apc-enabled=false turn it off
    max_kv_size: int = 0  # --max-kv-size (spec N); 0 = off
    decode_timeout_s: float = 600.0  # --decode-timeout (A8)
    slot_save_path: str | None = None  # --slot-save-path (F12)
    kv_cache_bytes: int = 0  # --kv-cache-memory: cap on the KV pool; 0 = sized from the context alone
    cache_type_k: str = "bf16"  # --cache-type-k: f32 | bf16 | f16
    cache_type_v: str = "bf16"  # --cache-type-v
    # --decode-step: auto | compile | cuda-graph | eager (--no-compile). The CLI's default is auto;
    # an engine built in code runs eagerly unless asked, so it pays no compile time.
    decode_step: str = "eager"
    compile_cache_dir: str | None = None  # where compiled decode steps persist (under --models-dir)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"--parallel must be at least 1, not {self.max_num_seqs}")
        if self.max_kv_size and not MAX_KV_SIZE_MIN <= self.max_kv_size <= MAX_KV_SIZE_MAX:
            raise ValueError(
                f"--max-kv-size must be 0 (off) or between {MAX_KV_SIZE_MIN} and "
                f"{MAX_KV_SIZE_MAX}, not {self.max_kv_size}"
            )
        if self.ctx_size < 0:
            raise ValueError(f"--ctx-size must not be negative, not {self.ctx_size}")
        for flag, value in (("--cache-type-k", self.cache_type_k), ("--cache-type-v", self.cache_type_v)):
            if value not in CACHE_TYPES:
                raise ValueError(f"{flag} must be one of {', '.join(CACHE_TYPES)}; not {value!r}")
        if self.decode_step not in DECODE_STEPS:
            raise ValueError(f"--decode-step must be one of {', '.join(DECODE_STEPS)}; not {self.decode_step!r}")

    def decode_step_mode(self, device: str) -> str:
        """`auto` is compile on CPU, CUDA graphs on CUDA."""
        if self.decode_step != "auto":
            return self.decode_step
        return "cuda-graph" if device.startswith("cuda") else "compile"

    def slot_context(self, model_context: int) -> int:
        """Per-slot context: ctx / parallel when --ctx-size is given (as llama-server reports it)."""
        if self.ctx_size:
            return max(self.ctx_size // self.max_num_seqs, self.block_size)
        return model_context

    def num_blocks(self, model_context: int, bytes_per_token: int) -> int:
        """KV blocks for every slot's full context, capped by the memory budget when one is set.

        A smaller pool still serves every slot: blocks are shared and handed out on demand, and
        when they run out the newest request is preempted and recomputed later.
        """
        per_slot = self.slot_context(model_context)
        if self.max_kv_size:
            per_slot = min(per_slot, self.max_kv_size + 2 * self.block_size)
        blocks_per_slot = -(-per_slot // self.block_size) + 1
        wanted = blocks_per_slot * self.max_num_seqs
        if not self.kv_cache_bytes:
            return wanted
        affordable = self.kv_cache_bytes // (bytes_per_token * self.block_size)
        if affordable < blocks_per_slot:
            raise ValueError(
                f"--kv-cache-memory {self.kv_cache_bytes} bytes holds {affordable * self.block_size} tokens, "
                f"less than one slot's context ({per_slot} tokens); raise it or lower --ctx-size"
            )
        return min(wanted, affordable)
