"""Plain data shared by every layer: the one internal request type and what the engine emits.

Every protocol adapter translates its JSON into `Request` and builds its replies from
`TokenEvent`s; the engine knows nothing else (DESIGN.md rule 1).
"""

from __future__ import annotations

import enum
import functools
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


class Priority(enum.IntEnum):
    """Prefill queue order (spec L): lower value is served first."""

    HIGH = 0
    NORMAL = 1
    LOW = 2

    @classmethod
    def parse(cls, value: str | None) -> Priority:
        if not value:
            return cls.NORMAL
        try:
            return cls[value.strip().upper()]
        except KeyError:
            raise ValueError(f"priority must be high, normal or low, not {value!r}") from None


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an end-of-sequence or stop token (stop strings are matched above the engine)
    LENGTH = "length"  # max_tokens or the context reached
    ABORT = "abort"  # the caller aborted, or the server is shutting down
    LOOP = "loop"  # the n-gram repeat guard ended a looping generation (spec P)
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token. Defaults are greedy-free sampling at temperature 1."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0  # locally typical sampling (llama-server's typical_p); 1 = off
    xtc_probability: float = 0.0  # XTC: the chance that a step removes its likeliest tokens; 0 = off
    xtc_threshold: float = 0.1  # XTC removes every token this likely but the least likely of them (> 0.5: off)
    top_n_sigma: float = -1.0  # keeps the logits within n standard deviations of the best; <= 0 = off
    dynatemp_range: float = 0.0  # dynamic temperature: temperature +- this, by the survivors' entropy; 0 = off
    dynatemp_exponent: float = 1.0
    mirostat: int = 0  # 1 or 2: mirostat in place of the truncations (engine/mirostat.py); 0 = off
    mirostat_tau: float = 5.0  # the target surprise, in bits
    mirostat_eta: float = 0.1  # the learning rate
    dry_multiplier: float = 0.0  # DRY's penalty scale (engine/dry.py); 0 = off
    dry_base: float = 1.75
    dry_allowed_length: int = 2  # repeats up to this long go free
    dry_penalty_last_n: int = 64  # how many of the last tokens DRY scans; -1 = the whole context, 0 = off
    dry_breakers: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (head token, the tokens completing it) per breaker
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64  # window for the three penalties; -1 = whole context, 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    max_tokens: int | None = None  # None = until the context is full
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = no logprobs; N = chosen token plus N alternatives
    is_post_sampling_probs: bool = False  # logprobs of the distribution after the sampler chain (llama-server)
    prompt_logprobs: int | None = None  # None = off; N = each prompt token's logprob plus the top N (vLLM)

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def has_dynatemp(self) -> bool:
        return self.dynatemp_range > 0.0 and not self.is_greedy

    @property
    def has_llama_cpp_steps(self) -> bool:
        """Whether the chain has a typical-p, XTC, top-n-sigma or dynamic temperature step (llama-server's; the
        sampler's fully sorted path takes such rows)."""
        return (self.typical_p < 1.0 or (self.xtc_probability > 0.0 and self.xtc_threshold <= 0.5)
                or self.top_n_sigma > 0.0 or self.has_dynatemp)


class TokenProcessor(Protocol):
    """A per-request plug-in on the sampling path (grammar masks, reasoning budget, loop guard).

    `process` may change one row's logits in place before sampling; `accept` sees each
    chosen token and may end the request. One object per request: it may keep state.
    """

    def process(self, logits: torch.Tensor, output_ids: Sequence[int]) -> None: ...

    def accept(self, token_id: int) -> FinishReason | None: ...


@runtime_checkable
class MaskingProcessor(TokenProcessor, Protocol):
    """A processor whose only change to a row is a mask (a grammar): the sampler asks it for packed bits
    and masks every such row of the batch at once (engine/sampler.py)."""

    def fill_mask(self, words: torch.Tensor) -> bool:
        """Fill `words` (int32 [ceil(vocab / 32)], host: token t = bit t % 32 of word t // 32) with the tokens
        allowed next; False when nothing is masked this step."""
        ...


def apply_masks(logits: torch.Tensor, words: torch.Tensor) -> None:
    """Rows of `MaskingProcessor` bits (`words` [rows, ceil(vocab / 32)] int32) onto logits [rows, vocab] in place,
    as one batch: every token not allowed gets -inf.

    Each mask byte indexes a table of its 8 tokens' addends (0 allowed, -inf not), added to the logits: on 2 CPU
    cores 64 rows of 49,152 took 0.7 ms so and 5-7 ms through a boolean mask and `masked_fill_`
    (bench/grammar_masks.py)."""
    import torch  # this module stays importable without it (types only)

    vocab, table = logits.shape[-1], _mask_addends(str(logits.device))
    packed = words.to(logits.device).view(torch.uint8)  # little-endian: token t is bit t % 8 of byte t // 8
    # On the CPU a few rows at a time: a small buffer of addends, not fresh pages for the whole batch
    # (64 rows at once took 4 or 11 ms by turns); a GPU takes the batch in one go.
    step = packed.shape[0] if logits.device.type == "cuda" else CPU_MASK_ROWS
    for start in range(0, packed.shape[0], step):
        part = packed[start:start + step]
        addends = table.index_select(0, part.flatten().int()).view(part.shape[0], -1)
        logits[start:start + step].add_(addends[:, :vocab].to(logits.dtype))


CPU_MASK_ROWS = 8


@functools.cache
def _mask_addends(device: str) -> torch.Tensor:
    """[256, 8] float32: for each byte value, 0 for its set bits and -inf for the others (bit order: low first)."""
    import torch

    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.where(bits == 1, 0.0, float("-inf")).to(device)


@dataclass(slots=True)
class Request:
    """One generation request as the engine sees it: token ids in, token ids out."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: Priority = Priority.NORMAL
    cache_prompt: bool = True  # spec M: False = no prefix-cache read and no donation
    slot_id: int | None = None  # llama-server id_slot; None = any
    arrival_time: float = field(default_factory=time.monotonic)
    processors: tuple[TokenProcessor, ...] = ()
    lora_scales: tuple[float, ...] = ()  # F8: one scale per loaded adapter; () = the base model
    report_progress: bool = False  # llama-server return_progress: a PromptProgress event per prefill chunk
    images: tuple[bytes, ...] = ()  # U: encoded images for a model with a vision tower, one per image marker
    # Issue 43: the prompt's images, processed, with the placeholder positions their embeddings replace
    image_inputs: tuple[ImageInput, ...] = ()
    # In-process tools (`mlxcel perplexity`): called with (first position, logits [n, vocab] float32) for
    # every prompt position that predicts a prompt token, in order, each position once.
    prompt_logits: Callable[[int, torch.Tensor], None] | None = None

    @property
    def wants_prompt_logits(self) -> bool:
        """Every prompt position's logits are needed: no prefix-cache read may skip computing them."""
        return self.sampling.prompt_logprobs is not None or self.prompt_logits is not None

    @property
    def cache_extra(self) -> object:
        """What the prefix cache keys blocks by besides tokens: KV under other LoRA scales differs; with
        images, each block's key also holds the digests of the images whose placeholders it overlaps."""
        base = lora_cache_extra(self.lora_scales)
        return ImageCacheKeys.of(base, self.image_inputs) if self.image_inputs else base


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One image of a prompt (issue 43), as a vision-language family's processor made it.

    `runs` are the (first position, length) runs of placeholder tokens in the prompt whose input
    embeddings the image's encoder output replaces, in order: the encoder gives `num_tokens` rows
    [num_tokens, hidden] (Gemma 3: one run of mm_tokens_per_image; SmolVLM: one run per tile).
    `pixels` are the processor's tensors for this image alone (pixel_values and whatever else the
    family's encoder takes), on the host. `digest` (sha256 of the decoded pixels' source bytes)
    keys the prefix cache. `is_bidirectional`: the placeholders of each run attend each other both
    ways in prefill (Gemma 3), not only causally; a run is then never split across prefill chunks.
    """

    digest: str
    runs: tuple[tuple[int, int], ...]
    pixels: dict[str, torch.Tensor]
    is_bidirectional: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(length for _, length in self.runs)

    def positions(self) -> list[int]:
        return [start + i for start, length in self.runs for i in range(length)]


@dataclass(frozen=True, slots=True)
class ImageCacheKeys:
    """A prefix-cache `extra` that differs per block (issue 43, vLLM's scheme): block [start, end)
    is keyed by `base` plus the digests of the images with a placeholder in it; later blocks depend
    on the image through the chain hash. `for_block` gives the key of one block."""

    base: object
    spans: tuple[tuple[int, int, str], ...]  # (first position, end position, digest) of each run

    @staticmethod
    def of(base: object, images: Sequence[ImageInput]) -> ImageCacheKeys:
        spans = tuple((start, start + length, image.digest) for image in images for start, length in image.runs)
        return ImageCacheKeys(base, spans)

    def for_block(self, start: int, end: int) -> object:
        digests = tuple(digest for first, stop, digest in self.spans if first < end and stop > start)
        return (self.base, ("images", digests)) if digests else self.base


class ImagePrompter(Protocol):
    """A vision-language model's processor as the API layer uses it (issue 43; built by the family
    module, models/_vision.py). `marker` is the text one image part renders as in the chat prompt;
    `prepare` expands each marker in the prompt's token ids into the image's placeholder tokens and
    processes the images (decode, resize, normalise, as the checkpoint's processor settings say).
    It is slow (pixels): the API layer calls it off the event loop."""

    marker: str

    def prepare(self, token_ids: list[int], images: Sequence[bytes]) -> tuple[list[int], tuple[ImageInput, ...]]: ...


def lora_cache_extra(lora_scales: tuple[float, ...]) -> tuple[str, tuple[float, ...]] | None:
    """The prefix-cache key of KV computed under these adapter scales (F8); None for the base model
    (no adapters, or every scale 0), so base-model KV is shared whatever adapters are loaded."""
    return ("lora", tuple(lora_scales)) if any(lora_scales) else None


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first
    rank: int | None = None  # the token's rank in the distribution (1 = most likely); set for prompt tokens


@dataclass(frozen=True, slots=True)
class PromptProgress:
    """llama-server's `prompt_progress`, sent once before the first prefill chunk (processed == cache)
    and after each chunk: `processed` counts the prompt tokens in the slot so far, the `cache` hits
    included, so the last chunk's equals `total`."""

    total: int
    cache: int
    processed: int
    time_ms: int  # since the request's prompt processing began (its first admission to a slot)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """What one engine step produced for one request.

    `token_ids` holds the new tokens (more than one after an accepted speculative draft).
    The last event of a request carries `finish_reason`. A request with `report_progress` also gets
    events with `progress` set and no tokens: one before its first prefill chunk, one after each.
    """

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None
    error_status: int = 500  # the HTTP status of an ERROR event (504: a serial worker's deadline passed)
    progress: PromptProgress | None = None
    num_drafted: int = 0  # the request's draft tokens verified so far (B1-B4; llama-server timings.draft_n)
    num_draft_accepted: int = 0  # of those, the ones the target accepted
    # With SamplingParams.prompt_logprobs: one entry per prompt token (None for the first, which has no
    # context), carried once, by the request's first event with a token or its finish.
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    def __reduce__(self) -> tuple[type[TokenEvent], tuple]:
        # Pickled for every token between the engine process and the API process (issue 25): the fields
        # as constructor arguments load 2x faster than dataclasses' per-field state of a slotted class.
        return TokenEvent, _token_event_fields(self)


_token_event_fields = operator.attrgetter(*TokenEvent.__slots__)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class EngineError(Exception):
    """Base of the errors the engine client raises to the API layer."""


class QueueFullError(EngineError):
    """The waiting queue is at --max-queue-depth; the server answers 503 with Retry-After."""


class ContextOverflowError(EngineError):
    """The prompt (plus at least one generated token) does not fit a slot's context; 400."""

    def __init__(self, num_prompt_tokens: int, context_size: int) -> None:
        super().__init__(
            f"the request has {num_prompt_tokens} prompt tokens, which exceeds the "
            f"available context size ({context_size} tokens)"
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.context_size = context_size


class RequestMemoryError(EngineError):
    """The request's estimated KV memory (prompt + max output) is over the budget (spec O); 503."""

    def __init__(self, request_id: str, estimated_bytes: int, budget_bytes: int) -> None:
        super().__init__(
            f"request {request_id} needs an estimated {estimated_bytes} bytes of KV memory (prompt plus "
            f"max_tokens), over the request memory budget of {budget_bytes} bytes; lower max_tokens or the prompt"
        )
        self.estimated_bytes = estimated_bytes
        self.budget_bytes = budget_bytes


class EngineShutdownError(EngineError):
    """The engine is stopping and takes no new requests."""


@dataclass(frozen=True, slots=True)
class SlotStats:
    slot_id: int
    is_processing: bool
    request_id: str | None
    num_prompt_tokens: int
    num_generated_tokens: int
    context_size: int
    num_remaining_tokens: int = -1  # max_tokens left to generate; -1: idle or no limit
    num_cached_tokens: int = 0  # the running request's prompt tokens from the prefix cache, RAM or disk
    # issue 41, a hybrid model: the slot's recurrent state (its live and verify slots of the pool), and the
    # snapshots of the running request's prefix the pool holds (what a later request may resume from)
    num_state_bytes: int = 0
    num_state_snapshots: int = 0


@dataclass(frozen=True, slots=True)
class RecurrentStateStats:
    """A hybrid model's recurrent-state pool (issue 41): fixed at startup, held beside the KV blocks."""

    bytes_per_slot: int  # one sequence's conv and recurrent states over every recurrent layer
    num_slots: int  # live, verify and snapshot slots (and the zero scratch slot)
    num_bytes: int  # the whole pool: what --kv-cache-memory holds beside the blocks
    num_snapshots: int  # prefix snapshots held in RAM
    num_snapshot_slots: int  # the most it holds
    num_resumed: int = 0  # sequences that started from a snapshot


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    is_enabled: bool
    num_hits: int = 0  # requests that reused at least one cached block
    num_misses: int = 0
    num_reused_tokens: int = 0
    num_blocks_used: int = 0
    num_blocks_free: int = 0
    num_blocks_cached: int = 0  # free but still holding a reusable prefix
    num_evictions: int = 0
    disk: DiskCacheStats | None = None  # the disk tier under it (issue 29); None = off
    host: HostCacheStats | None = None  # the host-memory tier between it and the disk (issue 29 point 5)


@dataclass(frozen=True, slots=True)
class HostCacheStats:
    """The prefix cache's host-memory tier (issue 29 point 5): device evictions parked in (pinned) host RAM."""

    capacity_bytes: int
    is_pinned: bool = False  # page-locked buffers (CUDA): the copies run asynchronously
    num_hits: int = 0  # device misses served from host memory
    num_misses: int = 0  # device misses host memory could not serve (the disk tier is asked next)
    num_blocks_stored: int = 0  # device evictions copied in
    num_blocks_loaded: int = 0  # copied back into the device pool
    num_blocks_spilled: int = 0  # evicted from host memory to the disk tier
    num_blocks_dropped: int = 0  # device evictions not kept (no host row ready yet): recomputed if asked again
    num_bytes_stored: int = 0
    num_bytes_loaded: int = 0
    load_seconds: float = 0.0  # engine-thread time issuing the loads (on CUDA the copies themselves are async)
    num_blocks: int = 0
    size_bytes: int = 0


@dataclass(frozen=True, slots=True)
class DiskCacheStats:
    """The prefix cache's disk tier (issue 29): what it found, wrote, read and holds."""

    directory: str
    capacity_bytes: int
    is_writable: bool = True  # False after a failed write (read-only or full): RAM-only from then on
    num_hits: int = 0  # requests that loaded at least one block from disk
    num_misses: int = 0  # RAM misses the disk could not serve either
    num_skipped: int = 0  # disk hits left to recompute (loading measured slower than computing)
    num_blocks_written: int = 0
    num_blocks_read: int = 0
    num_bytes_written: int = 0
    num_bytes_read: int = 0
    load_seconds: float = 0.0
    num_bad_files: int = 0  # checksum, header or key mismatches: skipped and deleted
    num_write_errors: int = 0  # failed writes (disk full, read-only)
    num_blocks_dropped: int = 0  # evicted blocks not saved because the writer was behind (never waited for)
    num_files: int = 0
    size_bytes: int = 0


@dataclass(frozen=True, slots=True)
class PrefixCacheReset:
    """What POST /v1/cache/reset dropped (F7; issue 29: the host and disk tiers too)."""

    is_reset: bool  # False when prefix caching is off: nothing was touched
    num_blocks: int = 0  # cached blocks of the device (or CPU) pool whose hashes were dropped
    num_host_blocks: int = 0  # blocks of the host-memory tier (issue 29 point 5)
    num_disk_files: int = 0  # block files of this server's KV identity deleted from the disk tier
    num_disk_bytes: int = 0


# F10: the batch-1 multi-token-prediction (MTP) decision, as GET /v1/internal/mtp-policy reports it.
MTP_POLICY_VERSION = 1
MTP_STATES = ("settled", "profiling", "forced", "unavailable", "exactness_declined")


@dataclass(frozen=True, slots=True)
class MtpProfile:
    """Batch-1 decode steps measured with and without MTP drafts (the `--mtp auto` profile)."""

    num_steps_on: int = 0
    num_steps_off: int = 0
    tokens_per_second_on: float = 0.0
    tokens_per_second_off: float = 0.0


@dataclass(frozen=True, slots=True)
class MtpDecision:
    """Whether batch-1 decoding drafts with the checkpoint's own MTP heads, and why (F10)."""

    state: str  # one of MTP_STATES
    reason: str
    num_mtp_layers: int = 0  # MTP layers the checkpoint declares
    is_enabled: bool = False  # B=1 decode drafts with them now (False while profiling)
    profile: MtpProfile | None = None  # what profiling measured so far

    def __post_init__(self) -> None:
        if self.state not in MTP_STATES:
            raise ValueError(f"MTP state must be one of {', '.join(MTP_STATES)}; not {self.state!r}")


@dataclass(frozen=True, slots=True)
class DiffusionStats:
    """A block-diffusion worker's figures (spec U): /health's `block_diffusion`, /metrics' `mlxcel_block_diffusion_*`."""

    sampler: str
    canvas_length: int  # tokens committed per block
    num_blocks: int  # blocks committed
    num_steps: int  # denoising forward passes
    num_timed_out: int  # requests past --diffusion-request-timeout (504)
    queue_depth: int
    max_queue_depth: int


@dataclass(frozen=True, slots=True)
class DraftStats:
    """Speculative decoding (B1-B4): its configuration and the draft tokens verified / accepted."""

    kind: str = "none"
    draft_max: int = 0
    draft_min: int = 0
    max_batch: int = 0
    draft_model: str | None = None
    num_drafted: int = 0
    num_accepted: int = 0
    num_rounds: int = 0  # verify steps (llamacpp:spec_decode_num_drafts_total)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Everything /health, /slots and /metrics print, taken in one consistent snapshot."""

    active_sequences: int
    queue_depth: int
    max_batch_size: int
    sequences_started: int
    sequences_completed: int
    tokens_generated: int
    prompt_tokens_processed: int
    context_size: int  # per slot
    slots: tuple[SlotStats, ...]
    prefix_cache: PrefixCacheStats
    sequences_aborted: int = 0  # started, then aborted: started = completed + aborted + running
    is_alive: bool = True  # False once the engine loop died (/health 503, the server exits 1)
    num_steps: int = 0  # forward passes run (llama-server's n_decode_total)
    num_busy_slot_steps: int = 0  # running sequences summed over those steps (n_busy_slots_per_decode)
    max_sequence_len: int = 0  # longest sequence computed so far, prompt + output (n_tokens_max)
    drafts: DraftStats = DraftStats()
    diffusion: DiffusionStats | None = None  # set when a block-diffusion worker serves the model (U)
    recurrent_state: RecurrentStateStats | None = None  # a hybrid model's state pool (issue 41); None otherwise
