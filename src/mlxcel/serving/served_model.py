"""One served chat model: weights, tokenizer, chat template and its engine, built the same way in
either process (issue 25): in the API process when the engine runs there (`chat_model`), or in the
engine process (`engine_process.engine_process_main`). `RuntimeOptions` and `ServedModel` are what
both sides hold; `build_served` loads the weights, applies the decode rewrite and LoRA adapters,
builds the drafter and the `EngineCore` (A1, A6: resolve -> tokenizer and template -> weights -> engine
-> warmup).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from mlxcel.config import EngineConfig
from mlxcel.engine.admission import MemoryBudget
from mlxcel.engine.client import EngineClient
from mlxcel.engine.loop import EngineCore, ModelShape
from mlxcel.chat.plan import ChatFeatures, FeatureSettings
from mlxcel.engine.spec import DraftPolicy
from mlxcel.engine.spec.mtp import MtpDraftPolicy, decide_mtp
from mlxcel.layers.lora import AdapterError, apply_adapters, load_adapter  # AdapterError: build_served raises it
from mlxcel.layers.quant import can_quantize, fuse_projections, quantize, resident_bytes
from mlxcel.layers.quant_cuda import keep_quantized
from mlxcel.loading import Checkpoint, LoadedModel, ModelLoadError, ResolvedModel, load_weights, release_load_memory
from mlxcel.loading.sampling import checkpoint_sampling
from mlxcel.loading.checkpoint import family_module
from mlxcel.loading.lazy import materialize_all
from mlxcel.loading.mmproj import attach_mmproj
from mlxcel.lora_registry import LoraRegistry
from mlxcel.text.chat_template import ChatTemplate
from mlxcel.text.tokenizer import Tokenizer
from mlxcel.types import ImagePrompter, MtpDecision, Request, SamplingParams
from mlxcel.workers.diffusion import DiffusionOptions

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class RuntimeOptions:
    device: str = "cpu"
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    chat_template: str | None = None  # --chat-template: a built-in name or Jinja source
    chat_template_file: Path | None = None
    warmup: bool = True
    quantize: str = "auto"  # --quantize: auto = packed weight-only decode matmuls on CPU, off = keep dtype
    threads: int = 0  # --threads: torch intra-op threads; 0 = torch's default (every core)
    chat: FeatureSettings = FeatureSettings()  # reasoning, budget, template kwargs, loop guard, echo (S-V)
    adapters: tuple[tuple[Path, float], ...] = ()  # --adapter / --lora / --lora-scaled: (path, scale) (F8)
    weight_materialization: str = "eager"  # MLXCEL_WEIGHT_MATERIALIZATION: eager | lazy (A6)
    diffusion: DiffusionOptions = DiffusionOptions()  # a block-diffusion checkpoint's sampler and steps (U)
    engine_process: str = "off"  # --engine-process: auto | on | off (issue 25: the engine core in a child process)
    mmproj: Path | None = None  # --mmproj: llama.cpp's projector GGUF beside a GGUF model (issue 43)

    def is_quantized(self) -> bool:
        if self.quantize not in ("auto", "off"):
            raise ValueError(f"--quantize must be auto or off; not {self.quantize!r}")
        return self.quantize == "auto" and self.device == "cpu" and can_quantize()

    def keeps_quantized_on_cuda(self, checkpoint: Checkpoint) -> bool:
        """Issue 42: a quantized folder on CUDA keeps its 4-bit and FP8 linears as stored (layers/quant_cuda.py)."""
        return self.quantize == "auto" and self.device.startswith("cuda") and checkpoint.quant is not None

    def runs_engine_process(self) -> bool:
        """Issue 25: auto is on with a GPU, where the server with the split reached 1.3-1.6x the one-process
        server's tokens a second at 64 and 256 streams on an H200 (three runs), and off on the CPU, where on 2
        cores a second busy process competes with the engine for them (docs/structure.md, bench/RESULTS.md)."""
        if self.engine_process not in ("auto", "on", "off"):
            raise ValueError(f"--engine-process must be auto, on or off; not {self.engine_process!r}")
        return self.engine_process == "on" or (self.engine_process == "auto" and self.device.startswith("cuda"))

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        try:
            return DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"--dtype must be one of auto, {', '.join(DTYPES)}; not {self.dtype!r}") from None


@dataclass
class ServedModel:
    name: str
    loaded: LoadedModel
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    engine: EngineClient
    engine_config: EngineConfig
    features: ChatFeatures  # S, R, Q, P, V: built once, with the model (build_chat_features)
    lora: LoraRegistry = field(default_factory=LoraRegistry)  # F8: the adapters and their global scales
    mtp_decision: MtpDecision | None = None  # F10, where it needs no measuring (else the engine's policy holds it)
    image_marker: str | None = None  # U: the image placeholder of a model with a vision tower (None: text only)
    weights: dict[str, Any] = field(default_factory=dict)  # issue 42: format, bits, resident bytes (/props, /v1/models)
    image_prompter: ImagePrompter | None = None  # issue 43: a vision-language model's processor side

    @property
    def context_size(self) -> int:
        """Per-slot context, as /health and /props report it."""
        return self.engine.core.slot_context

    @property
    def mtp(self) -> MtpDecision:
        """The batch-1 MTP decision for this checkpoint (F10): the MTP policy's live one while it drafts."""
        drafts = self.engine.core.drafts
        if isinstance(drafts, MtpDraftPolicy):
            return drafts.decision
        return self.mtp_decision or decide_mtp(self.loaded.config) or MtpDecision("unavailable", "not drafting")

    @property
    def checkpoint_sampling(self) -> dict[str, Any]:
        """The checkpoint's own sampling defaults (generation_config.json / GGUF general.sampling.*, issue 46)."""
        return checkpoint_sampling(self.loaded.gguf.metadata if self.loaded.gguf else None, self.loaded.model_dir)

    def close(self, timeout: float = 120.0) -> bool:
        return self.engine.core.stop(timeout)


def load_tokenizer(checkpoint: Checkpoint | LoadedModel) -> Tokenizer:
    """The checkpoint's tokenizer (GGUF metadata or tokenizer.json); errors name the file."""
    try:
        if checkpoint.gguf is not None:
            tokenizer = Tokenizer.from_gguf(checkpoint.gguf.metadata)
        else:
            assert checkpoint.model_dir is not None
            tokenizer = Tokenizer.from_pretrained_dir(checkpoint.model_dir)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{checkpoint.path}: {exc}") from exc
    tokenizer.cover_model_rows(_num_embedding_rows(checkpoint.config))  # issue 44: padded ids are served
    return tokenizer


def _num_embedding_rows(config: dict[str, Any]) -> int:
    """The model's vocabulary size (its embedding rows), from the top level or a text_config; 0 if absent."""
    for scope in (config, config.get("text_config") or {}):
        value = scope.get("vocab_size") if isinstance(scope, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0


def build_chat_features(name: str, loaded: LoadedModel, tokenizer: Tokenizer, template: ChatTemplate | None,
                        settings: FeatureSettings) -> ChatFeatures:
    """Reasoning markers, tool-call format, grammar compiler and echo store for one model; a
    ValueError for settings that cannot work (the server refuses to start)."""
    return ChatFeatures.build(tokenizer, template, settings, model_name=name, model_type=loaded.model_type)


def model_shape(loaded: LoadedModel) -> ModelShape:
    return ModelShape.of(loaded.model.args)


class DraftMismatchError(ValueError):
    """The draft model cannot draft for the target (B1, B3): startup is refused with exit 2."""


class MemoryBudgetError(ValueError):
    """MLXCEL_REQUEST_MEMORY_BUDGET holds no KV block of the model, so no request could ever run:
    startup is refused with exit 2."""


def check_memory_budget(budget: MemoryBudget) -> None:
    """Spec O: refuse a budget below one KV block, naming the minimum (smaller ones are served, the
    warmup fitting itself to them)."""
    minimum = budget.block_bytes + budget.state_bytes  # issue 41: a hybrid's request holds its recurrent state too
    if budget.budget_bytes < minimum:
        state = f" and one sequence's recurrent state ({budget.state_bytes} bytes)" if budget.state_bytes else ""
        raise MemoryBudgetError(
            f"MLXCEL_REQUEST_MEMORY_BUDGET: {budget.budget_bytes} bytes cannot hold one KV block of this model "
            f"({budget.block_size} tokens){state}; the minimum is {minimum} bytes")


def check_draft_vocab(target_path: Path, target: Tokenizer, draft_path: Path, draft: Tokenizer) -> None:
    """B1: the draft model must have the target's vocabulary (the same token for every id)."""
    if target.backend.get_vocab(with_added_tokens=True) != draft.backend.get_vocab(with_added_tokens=True):
        raise DraftMismatchError(
            f"the draft model {draft_path} has a different vocabulary ({draft.vocab_size} tokens) from the "
            f"model {target_path} ({target.vocab_size} tokens); a drafter needs the target's tokenizer")


def build_served(resolved: ResolvedModel, checkpoint: Checkpoint, tokenizer: Tokenizer,
                  template: ChatTemplate | None, options: RuntimeOptions, engine_config: EngineConfig,
                  draft_checkpoint: Checkpoint | None = None) -> ServedModel:
    dtype = options.torch_dtype()
    is_lazy = options.weight_materialization == "lazy"
    loaded = _load_for_decode(checkpoint, options, lazy=is_lazy)
    if options.mmproj is not None:  # issue 43: the vision side from llama.cpp's projector file
        attach_mmproj(loaded.model, options.mmproj, tokenizer)
    log.info("Model loaded: %s (%s, %s on %s; weights: %s; model code: %s)", resolved.name, loaded.model_type,
             dtype, options.device, _materialization(options, is_lazy, checkpoint), loaded.implementation)
    log.info("decode path: %s", _decode_path(loaded, options))
    weights = weights_report(loaded)
    log.info("weights: %s; %.1f MiB resident (files %.1f MiB)", weights["description"],
             weights["resident_bytes"] / 2**20, weights["file_bytes"] / 2**20)
    lora = _apply_adapters(loaded, options)
    features = build_chat_features(resolved.name, loaded, tokenizer, template, options.chat)
    log.info("tool-call format: %s", features.tool_parser_name)
    engine_config = _fit_engine_config(loaded, engine_config)
    is_drafting = draft_checkpoint is not None and engine_config.speculative.draft_kind == "full-model"
    drafts = _draft_policy(draft_checkpoint, options, engine_config) if is_drafting else None
    if engine_config.speculative.draft_kind == "dflash":
        drafts = _dflash_policy(loaded, resolved.path, options, engine_config)
    mtp = _mtp_decision(loaded, engine_config)
    if mtp is None:  # F10: the checkpoint's own MTP layers draft (--mtp auto or on)
        drafts, mtp = _mtp_policy(loaded, options, engine_config)
    if mtp is not None and mtp.num_mtp_layers:
        log.info("MTP policy: %s (%s)", mtp.state, mtp.reason)
    identity = kv_identity(loaded, tokenizer, options) if engine_config.prefix_cache_disk_bytes else ""
    core = EngineCore(loaded.model, model_shape(loaded), engine_config, eos_token_ids=tokenizer.eos_token_ids,
                      device=options.device, dtype=dtype, drafts=drafts, cache_identity=identity)
    check_memory_budget(core.memory_budget)
    if options.warmup:
        core.warm_decode_step()
        if drafts is not None and hasattr(drafts.drafter, "warm"):  # a draft model's own decode step (B1)
            log.info("draft model decode step ready in %.1f s", drafts.drafter.warm())
    prompter = image_prompter(loaded, tokenizer)
    return ServedModel(resolved.name, loaded, tokenizer, template, EngineClient(core), engine_config, features, lora,
                       mtp, weights=weights, image_marker=prompter.marker if prompter else None,
                       image_prompter=prompter)


def weights_report(loaded: LoadedModel) -> dict[str, Any]:
    """The checkpoint's weight format and bits (issue 42), the bytes its weights take in memory as served (after
    the CPU decode rewrite), and the bytes of its weight files."""
    files = [loaded.path] if loaded.model_dir is None else list(loaded.model_dir.glob("*.safetensors"))
    return {**loaded.weights_info(), "resident_bytes": resident_bytes(loaded.model),
            "file_bytes": sum(p.stat().st_size for p in files)}


def image_prompter(loaded: LoadedModel, tokenizer: Tokenizer) -> ImagePrompter | None:
    """The processor side of a vision-language model (issue 43, models/_vision.py); None for text only."""
    model = loaded.model
    if getattr(model, "vision", None) is None or not hasattr(model, "image_prompter"):
        return None
    prompter = model.image_prompter(loaded.model_dir, tokenizer)
    log.info("image input: on (marker %r)", prompter.marker)
    return prompter


_FINGERPRINT_BYTES = 1 << 20


def kv_identity(loaded: LoadedModel, tokenizer: Tokenizer, options: RuntimeOptions) -> str:
    """What makes this model's KV differ beyond its tokens (issue 29's disk key): the weight files, the
    `--mmproj` projector (image blocks' KV comes from its tower, issue 43), the config (RoPE included), the
    vocabulary, the weight rewrite and the LoRA adapters; a hex digest. The engine adds the KV element types,
    activation dtype and device."""
    digest = hashlib.sha256()
    files = [loaded.path] if loaded.model_dir is None else sorted(p for p in loaded.model_dir.iterdir() if p.is_file())
    files += [Path(options.mmproj)] if options.mmproj is not None else []
    for path in files + [f for adapter, _ in options.adapters for f in _adapter_files(Path(adapter))]:
        digest.update(_file_fingerprint(path))
    digest.update(json.dumps(loaded.config, sort_keys=True, default=str).encode())
    digest.update(f"vocab {tokenizer.vocab_size}|quantize {options.quantize} {options.is_quantized()}".encode())
    return digest.hexdigest()


def _adapter_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]


def _file_fingerprint(path: Path) -> bytes:
    """A file's name, size and first and last MiB: cheap for multi-GB weights, and any re-quantization
    or re-export changes them."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        head = file.read(_FINGERPRINT_BYTES)
        file.seek(max(size - _FINGERPRINT_BYTES, 0))
        tail = file.read(_FINGERPRINT_BYTES)
    return hashlib.sha256(f"{path.name}|{size}|".encode() + head + tail).digest()


def _draft_policy(checkpoint: Checkpoint, options: RuntimeOptions, config: EngineConfig) -> DraftPolicy:
    """B1: the draft model on the target's device and dtype, with its own paged KV (as many blocks as
    the target's slots need) and the target's decode-step mode."""
    from mlxcel.engine.spec.draft_model import ModelDrafter

    loaded = _load_for_decode(checkpoint, options)
    log.info("draft model loaded: %s (%s); decode path: %s", checkpoint.path, loaded.model_type,
             _decode_path(loaded, options))
    shape = model_shape(loaded)
    k_type, v_type = config.kv_element_types()
    num_blocks = config.num_blocks(shape.context_length, shape.kv_bytes_per_token(k_type, v_type))
    drafter = ModelDrafter(loaded.model, shape, num_blocks=num_blocks, block_size=config.block_size,
                           device=options.device, dtype=options.torch_dtype(), kv_types=(k_type, v_type),
                           mode=config.decode_step_mode(options.device),
                           max_rows=max(config.max_num_seqs, config.speculative.draft_max + 1),
                           enable_prefix_caching=config.enable_prefix_caching)
    return DraftPolicy(config.speculative, drafter)


def _dflash_policy(loaded: LoadedModel, path: Path, options: RuntimeOptions, config: EngineConfig) -> DraftPolicy:
    """B3: the DFlash drafter at --draft-model, on the target's device and dtype, reading its layers."""
    from mlxcel.engine.spec.dflash import DFlashCheckpointError, DFlashDrafter, load_dflash

    spec = config.speculative
    try:
        model = load_dflash(Path(spec.draft_model), loaded.model, device=options.device,
                            dtype=options.torch_dtype(), target_name=f"the model {path}")
    except DFlashCheckpointError as exc:
        raise DraftMismatchError(str(exc)) from exc
    log.info("DFlash drafter loaded: %s (%d layers, reads target layers %s, blocks of %d tokens)", spec.draft_model,
             model.spec.num_layers, list(model.spec.target_layer_ids), spec.block_size)
    return DraftPolicy(spec, DFlashDrafter(model, loaded.model, block_size=spec.block_size))


def _mtp_decision(loaded: LoadedModel, config: EngineConfig) -> MtpDecision | None:
    """F10's decision where it needs no measuring; None: the checkpoint's MTP layers draft (--mtp auto/on)."""
    family = family_module(loaded.model_type)
    return decide_mtp(loaded.config, family_runs_mtp=hasattr(family, "MTP_LAYERS_PREFIX"),
                      speculative=config.speculative, max_kv_size=config.max_kv_size)


def _mtp_policy(loaded: LoadedModel, options: RuntimeOptions,
                config: EngineConfig) -> tuple[MtpDraftPolicy | None, MtpDecision | None]:
    """F10: the checkpoint's first MTP layer (MiMo's) or MTP head of the target's own blocks (Qwen3-Next,
    Qwen3.5: `MTP_HEAD_PREFIXES`), read from its safetensors, drafting over the target; a checkpoint whose
    MTP weights are missing (an export that dropped them) is served without them."""
    from safetensors import safe_open

    from mlxcel.engine.spec.mtp import MtpDrafter, declared_mtp_layers, load_mtp_head, load_mtp_layer

    family = family_module(loaded.model_type)
    head_prefixes: tuple[str, ...] | None = getattr(family, "MTP_HEAD_PREFIXES", None)
    prefixes = head_prefixes or (family.MTP_LAYERS_PREFIX + "0.",)
    num_layers, key = declared_mtp_layers(loaded.config)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(loaded.model_dir.glob("*.safetensors")) if loaded.model_dir is not None else ():
        with safe_open(str(file), framework="pt") as handle:
            weights.update({name: handle.get_tensor(name) for name in handle.keys() if name.startswith(prefixes)})
    place = {"device": options.device, "dtype": options.torch_dtype()}
    try:
        layer = (load_mtp_head(loaded.model, weights, head_prefixes, **place) if head_prefixes else
                 load_mtp_layer(loaded.config, weights, prefixes[0], **place))
    except ValueError as exc:
        return None, MtpDecision("unavailable", f"the config declares {num_layers} MTP layer(s) ({key}), but {exc}",
                                 num_mtp_layers=num_layers)
    log.info("MTP drafter loaded: %s* (%d MTP layer(s) declared; --mtp %s)", prefixes[0], num_layers,
             config.speculative.mtp)
    policy = MtpDraftPolicy(config.speculative, MtpDrafter(layer, loaded.model), num_mtp_layers=num_layers)
    return policy, None


def _materialization(options: RuntimeOptions, is_lazy: bool, checkpoint: Checkpoint) -> str:
    """When the weights are read, as it happens on this path (issue 47: the load line said "mapped" and this one
    "eager" for the same load; both now tell the same story)."""
    if options.is_quantized():
        unused = ("; MLXCEL_WEIGHT_MATERIALIZATION=lazy does not apply, --quantize off keeps them lazy"
                  if is_lazy else "")
        return f"mapped, each linear read from the file as the CPU decode rewrite packs it, before serving{unused}"
    if options.keeps_quantized_on_cuda(checkpoint):
        return "mapped, each 4-bit or FP8 linear read from the file as it is packed for CUDA, the rest before serving"
    if not is_lazy:
        return "read in full at load (MLXCEL_WEIGHT_MATERIALIZATION=eager)"
    if options.device.startswith("cuda"):
        return "mapped, then read in full before serving, as fusing the projections needs them (lazy does not apply)"
    return "mapped, each tensor read when its module first runs (MLXCEL_WEIGHT_MATERIALIZATION=lazy)"


def _load_for_decode(checkpoint: Checkpoint, options: RuntimeOptions, *, lazy: bool = False) -> LoadedModel:
    """The checkpoint mapped, not read, where the CPU decode rewrite follows (`_decode_path`): it
    reads each linear as it packs it, so no float copy of the whole model is ever held."""
    return load_weights(checkpoint, device=options.device, dtype=options.torch_dtype(),
                        lazy=lazy or options.is_quantized() or options.keeps_quantized_on_cuda(checkpoint))


def _decode_path(loaded: LoadedModel, options: RuntimeOptions) -> str:
    if options.is_quantized():
        summary = quantize(loaded.model)  # reads each linear as it packs it
        materialize_all(loaded.model)  # the rest (norms, embeddings): the decode step reads them outside a forward
        release_load_memory(loaded.model)  # issue 42: the mapped files and the freed temporaries let go
        return f"{summary}; {options.torch_dtype()} activations and KV cache"
    if options.device.startswith("cuda"):  # fewer, wider GEMMs in each captured decode step
        # Issue 42: a quantized folder's 4-bit and FP8 linears stay as stored, read as they are packed.
        kept = (f"{keep_quantized(loaded.model, options.device)}; " if loaded.quant is not None
                and options.quantize == "auto" else "")
        materialize_all(loaded.model)  # fusing needs every tensor (the "Model loaded" line says so)
        fused = fuse_projections(loaded.model)
        release_load_memory(loaded.model)
        return f"{kept}{options.torch_dtype()} linears and KV cache ({fused} projections fused into wider matmuls)"
    release_load_memory(loaded.model)  # lazy weights still pending keep their readers
    return f"{options.torch_dtype()} linears and KV cache (no quantization)"


def _apply_adapters(loaded: LoadedModel, options: RuntimeOptions) -> LoraRegistry:
    """A6: LoRA adapters after the weights, beside them (not merged); AdapterError if one does not fit."""
    if not options.adapters:
        return LoraRegistry()
    adapters = [load_adapter(path, scale) for path, scale in options.adapters]
    apply_adapters(loaded.model, adapters, device=options.device, dtype=options.torch_dtype())
    for index, adapter in enumerate(adapters):
        log.info("LoRA adapter %d: %s (scale %g, %d projections)", index, adapter.path, adapter.scale,
                 len(adapter.weights))
    return LoraRegistry([(str(a.path), a.scale) for a in adapters])


def _fit_engine_config(loaded: LoadedModel, config: EngineConfig) -> EngineConfig:
    """Settings the model overrides: families that cannot batch get one slot (A3) and no speculation
    (B4); models with their own sliding window ignore --max-kv-size (N)."""
    if not loaded.supports_batching and config.max_num_seqs != 1:
        log.warning("%s cannot batch requests: --parallel %d clamped to 1", loaded.model_type, config.max_num_seqs)
        config = replace(config, max_num_seqs=1)
    if not loaded.supports_batching and config.speculative.is_enabled:  # a verify round is a batch of rows
        log.warning("%s cannot batch rows: speculative decoding (--draft-kind %s) turned off", loaded.model_type,
                    config.speculative.draft_kind)
        config = replace(config, speculative=replace(config.speculative, draft_kind="none", draft_model=None))
    if config.max_kv_size and getattr(loaded.model.args, "sliding_window", None):
        log.info("--max-kv-size %d ignored: %s has its own sliding window", config.max_kv_size, loaded.model_type)
        config = replace(config, max_kv_size=0)
    return config


WARMUP_TEXT = ("Warm up the engine: a short prompt whose prefill and a few decode steps reach every kernel "
               "a first request would, so that it is served as fast as the tenth.")


def warmup(served: ServedModel) -> None:
    """Prefill a short prompt and decode a few tokens, so the first real request does not pay
    one-time costs (A6): kernel selection, allocator growth, the decode step's first calls."""
    started = time.monotonic()
    ids, num_output = _warmup_shape(served.tokenizer.encode(WARMUP_TEXT, add_special_tokens=True) or [0],
                                    served.engine.core.memory_budget.max_request_tokens)
    request = Request(f"warmup-{uuid.uuid4().hex[:8]}", ids,
                      SamplingParams(temperature=0.0, max_tokens=num_output, ignore_eos=True), cache_prompt=False)
    done = served.engine.core.call(lambda: None)  # make sure the loop thread runs
    done.result(timeout=60)
    _run_blocking(served, request)
    log.info("warmup done in %.2f s", time.monotonic() - started)


def _warmup_shape(ids: list[int], max_tokens: int, num_output: int = 8) -> tuple[list[int], int]:
    """The warmup's prompt and output length, cut to fit a small request memory budget (spec O)."""
    if len(ids) + num_output <= max_tokens:
        return ids, num_output
    num_output = max(1, min(num_output, max_tokens // 4))
    log.info("warmup cut to %d tokens to fit MLXCEL_REQUEST_MEMORY_BUDGET", max_tokens)
    return ids[:max(1, max_tokens - num_output)], num_output


def _run_blocking(served: ServedModel, request: Request) -> list[int]:
    import queue

    events: queue.SimpleQueue = queue.SimpleQueue()
    served.engine.core.submit(request, events.put)
    tokens: list[int] = []
    while True:
        event = events.get(timeout=600)
        tokens.extend(event.token_ids)
        if event.finish_reason is not None:
            return tokens
