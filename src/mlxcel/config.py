"""Small frozen configuration records, composed downward; derived values are computed, not stored."""

from __future__ import annotations

from dataclasses import dataclass, field

# KV cache element types, as llama-server spells them (--cache-type-k / --cache-type-v), and the
# source's Turbo KV quantization (spec N2: --kv-cache-mode / --kv-quant-scheme); see layers/kv_quant.py.
CACHE_TYPES = ("f32", "bf16", "f16", "q8_0")
KV_CACHE_MODES = ("default", "turbo4")
KV_QUANT_SCHEMES = ("none", "turboquant")
DECODE_STEPS = ("auto", "native", "compile", "cuda-graph", "eager")
# Speculative decoding draft kinds (B1-B3), as --draft-kind spells them.
DRAFT_KINDS = ("none", "prompt-lookup", "full-model", "dflash")
# --mtp (F10): drafting with a checkpoint's own MTP layers at batch 1: profile then settle, or forced.
MTP_MODES = ("auto", "on", "off")

MAX_KV_SIZE_MIN = 64
MAX_KV_SIZE_MAX = 2_147_483_647


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (B1-B4; llama-server flag names in comments)."""

    draft_kind: str = "none"  # --draft-kind: none | prompt-lookup | full-model | dflash
    draft_max: int = 16  # --draft-max: most draft tokens a verify round checks
    draft_min: int = 0  # --draft-min: shorter drafts are not verified (the row decodes plainly)
    max_batch: int = 2  # --prompt-lookup-max-batch: speculate only while this many rows or fewer run
    ngram_size: int = 3  # --prompt-lookup-ngram: longest suffix n-gram looked up in the context
    draft_model: str | None = None  # --draft-model (full-model)
    block_size: int = 16  # --draft-block-size (dflash)
    mtp: str = "auto"  # --mtp: auto | on | off (checkpoints with MTP layers; F10)

    def __post_init__(self) -> None:
        if self.draft_kind not in DRAFT_KINDS:
            raise ValueError(f"--draft-kind must be one of {', '.join(DRAFT_KINDS)}; not {self.draft_kind!r}")
        if self.mtp not in MTP_MODES:
            raise ValueError(f"--mtp must be one of {', '.join(MTP_MODES)}; not {self.mtp!r}")
        if self.draft_max < 1:
            raise ValueError(f"--draft-max must be at least 1, not {self.draft_max}")
        if not 0 <= self.draft_min <= self.draft_max:
            raise ValueError(f"--draft-min must lie between 0 and --draft-max ({self.draft_max}), not {self.draft_min}")
        if self.max_batch < 1:
            raise ValueError(f"--prompt-lookup-max-batch must be at least 1, not {self.max_batch}")
        if self.ngram_size < 1:
            raise ValueError(f"--prompt-lookup-ngram must be at least 1, not {self.ngram_size}")

    @property
    def is_enabled(self) -> bool:
        return self.draft_kind != "none"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine batches and caches (llama-server flag names in comments)."""

    max_num_seqs: int = 4  # --parallel
    ctx_size: int = 0  # --ctx-size: total tokens over all slots; 0 = model context per slot
    max_num_batched_tokens: int = 2048  # --batch-size: tokens one step may compute
    # --ubatch-size: prompt tokens one step may compute (at most max_num_batched_tokens). Decode rows do
    # not count against it: 256 decode rows left a 512-token step room for two 128-token prompts (issue 25).
    max_num_prefill_tokens: int = 512
    block_size: int = 16
    max_queue_depth: int = 64  # --max-queue-depth
    enable_prefix_caching: bool = True  # --no-prompt-cache / --apc-enabled=false turn it off
    prefix_cache_dir: str | None = None  # --prefix-cache-dir: the disk tier's folder (issue 29)
    prefix_cache_disk_bytes: int = 0  # --prefix-cache-disk-size: its LRU bound; 0 = no disk tier, -1 = auto (CPU only)
    prefix_cache_host_bytes: int = 0  # --prefix-cache-host-size: host KV tier bound; 0 = off, -1 = auto (CUDA only)
    max_kv_size: int = 0  # --max-kv-size (spec N); 0 = off
    decode_timeout_s: float = 600.0  # --decode-timeout (A8)
    slot_save_path: str | None = None  # --slot-save-path (F12)
    kv_cache_bytes: int = 0  # --kv-cache-memory: cap on the KV pool; 0 = sized from the context alone
    request_memory_budget_bytes: int = 0  # MLXCEL_REQUEST_MEMORY_BUDGET (O): lowers the per-request budget; 0 = pool
    cache_type_k: str = "bf16"  # --cache-type-k: f32 | bf16 | f16 | q8_0
    cache_type_v: str = "bf16"  # --cache-type-v
    kv_cache_mode: str = "default"  # --kv-cache-mode: default | turbo4 (N2; overrides both cache types)
    kv_quant_scheme: str = "none"  # --kv-quant-scheme: none | turboquant (the same Turbo 4-bit store)
    # --decode-step: auto | native | compile | cuda-graph | eager (--no-compile). The CLI's default is auto;
    # an engine built in code runs eagerly unless asked, so it pays no compile time.
    decode_step: str = "eager"
    compile_cache_dir: str | None = None  # where compiled decode steps persist (under --models-dir)
    n_predict: int = -1  # --n-predict: max_tokens of requests that set none; -1 = none
    seed: int = -1  # --seed: the seed of requests that name none; -1 = random per request
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # B1-B4

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"--parallel must be at least 1, not {self.max_num_seqs}")
        if self.max_kv_size and not MAX_KV_SIZE_MIN <= self.max_kv_size <= MAX_KV_SIZE_MAX:
            raise ValueError(
                f"--max-kv-size must be 0 (off) or between {MAX_KV_SIZE_MIN} and "
                f"{MAX_KV_SIZE_MAX}, not {self.max_kv_size}"
            )
        if self.request_memory_budget_bytes < 0:
            raise ValueError(f"MLXCEL_REQUEST_MEMORY_BUDGET must be above 0, not {self.request_memory_budget_bytes}")
        if self.ctx_size < 0:
            raise ValueError(f"--ctx-size must not be negative, not {self.ctx_size}")
        if self.n_predict < -1 or self.n_predict == 0:
            raise ValueError(f"--n-predict must be -1 (no limit) or a positive number of tokens, not {self.n_predict}")
        if not -1 <= self.seed < 2**64:
            raise ValueError(f"--seed must be -1 (random) or between 0 and 2^64-1, not {self.seed}")
        for flag, value in (("--cache-type-k", self.cache_type_k), ("--cache-type-v", self.cache_type_v)):
            if value not in CACHE_TYPES:
                raise ValueError(f"{flag} must be one of {', '.join(CACHE_TYPES)}; not {value!r}")
        if self.kv_cache_mode not in KV_CACHE_MODES:
            raise ValueError(f"--kv-cache-mode must be one of {', '.join(KV_CACHE_MODES)}; not {self.kv_cache_mode!r}")
        if self.kv_quant_scheme not in KV_QUANT_SCHEMES:
            raise ValueError(f"--kv-quant-scheme must be one of {', '.join(KV_QUANT_SCHEMES)}; "
                             f"not {self.kv_quant_scheme!r}")
        if self.decode_step not in DECODE_STEPS:
            raise ValueError(f"--decode-step must be one of {', '.join(DECODE_STEPS)}; not {self.decode_step!r}")

    @property
    def is_turbo_kv(self) -> bool:
        return self.kv_cache_mode == "turbo4" or self.kv_quant_scheme == "turboquant"

    def kv_element_types(self) -> tuple[str, str]:
        """What keys and values are stored as: a Turbo mode or scheme overrides --cache-type-k/-v."""
        if self.is_turbo_kv:
            return "turbo4", "turbo4"
        return self.cache_type_k, self.cache_type_v

    def decode_step_mode(self, device: str) -> str:
        """`auto` is native on CPU (compile where the model's layers are not native: engine/native_step.py),
        CUDA graphs on CUDA."""
        if self.decode_step != "auto":
            return self.decode_step
        return "cuda-graph" if device.startswith("cuda") else "native"

    def slot_context(self, model_context: int) -> int:
        """Per-slot context: ctx / parallel when --ctx-size is given (as llama-server reports it)."""
        if self.ctx_size:
            return max(self.ctx_size // self.max_num_seqs, self.block_size)
        return model_context

    def num_blocks(self, model_context: int, bytes_per_token: int, *, state_bytes: int = 0) -> int:
        """KV blocks for every slot's full context, capped by the memory budget when one is set.

        A smaller pool still serves every slot: blocks are shared and handed out on demand, and
        when they run out the newest request is preempted and recomputed later. `state_bytes`: a
        hybrid model's recurrent-state pool (issue 41), which the budget holds beside the blocks.
        """
        per_slot = self.slot_context(model_context)
        if self.max_kv_size:
            per_slot = min(per_slot, self.max_kv_size + 2 * self.block_size)
        blocks_per_slot = -(-per_slot // self.block_size) + 1
        wanted = blocks_per_slot * self.max_num_seqs
        if not self.kv_cache_bytes:
            return wanted
        affordable = max(self.kv_cache_bytes - state_bytes, 0) // (bytes_per_token * self.block_size)
        if affordable < blocks_per_slot:
            states = f" beside the recurrent-state pool's {state_bytes} bytes" if state_bytes else ""
            raise ValueError(
                f"--kv-cache-memory {self.kv_cache_bytes} bytes holds {affordable * self.block_size} tokens{states}, "
                f"less than one slot's context ({per_slot} tokens); raise it or lower --ctx-size"
            )
        return min(wanted, affordable)
