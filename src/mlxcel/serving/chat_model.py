"""The chat model of the process `mlxcel serve` or `mlxcel generate` starts (A1, A6): its tokenizer and
template here, then its engine on a thread of this process, or in the engine process (issue 25:
`--engine-process`, `engine_process.start_engine_process`); a block-diffusion checkpoint by its own
worker here. What builds the model itself, in either process, is `served_model`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from mlxcel.config import EngineConfig
from mlxcel.engine.client import EngineClient
from mlxcel.loading import LoadedModel, ModelLoadError, ResolvedModel, open_checkpoint
from mlxcel.serving.engine_process import start_engine_process
from mlxcel.serving.served_model import (
    RuntimeOptions, ServedModel, build_chat_features, build_served, check_draft_vocab, load_tokenizer, warmup,
)
from mlxcel.text.chat_template import load_chat_template
from mlxcel.text.tokenizer import Tokenizer
from mlxcel.workers.diffusion import (
    BlockDiffusionWorker, is_block_diffusion_checkpoint, load_block_diffusion, vision_inputs,
)

log = logging.getLogger(__name__)


def start_served_model(resolved: ResolvedModel, options: RuntimeOptions, engine_config: EngineConfig,
                       draft: ResolvedModel | None = None) -> ServedModel:
    """A6 order: tokenizer and chat template (from the checkpoint's metadata) before the weights,
    so a bad template fails fast; then weights fully loaded, decode path, engine, warmup.

    The weights are loaded on the thread that then runs the engine loop, so one thread does
    all of the model's parallel work (see EngineCore.run_on_this_thread).
    """
    if options.threads > 0:
        torch.set_num_threads(options.threads)
    if is_block_diffusion_checkpoint(resolved.path):
        if options.engine_process == "on":  # its serial worker is not an EngineCore (issue 25); auto stays here
            raise ValueError(f"--engine-process on: {resolved.path} is a block-diffusion model, served by its own "
                             f"worker in this process; use --engine-process auto or off")
        return start_block_diffusion(resolved, options, engine_config)
    checkpoint = open_checkpoint(resolved.path)
    tokenizer = load_tokenizer(checkpoint)
    draft_checkpoint = open_checkpoint(draft.path) if draft is not None else None
    if draft is not None and draft_checkpoint is not None:
        check_draft_vocab(resolved.path, tokenizer, draft.path, load_tokenizer(draft_checkpoint))
    template = load_chat_template(
        override_source=options.chat_template, override_file=options.chat_template_file,
        gguf_metadata=checkpoint.gguf.metadata if checkpoint.gguf else None, model_dir=checkpoint.model_dir)
    log.info("chat template: %s", "from the model" if template and not (options.chat_template or options.chat_template_file)
             else ("override" if template else "none (chat routes answer 400; pass --chat-template)"))
    if options.runs_engine_process():
        return start_engine_process(resolved, checkpoint, tokenizer, template, options, engine_config, draft)
    served = _on_engine_thread(lambda: build_served(resolved, checkpoint, tokenizer, template, options, engine_config,
                                                    draft_checkpoint))
    if options.warmup:
        warmup(served)
    return served


def start_block_diffusion(resolved: ResolvedModel, options: RuntimeOptions, engine_config: EngineConfig) -> ServedModel:
    """Spec U: a DiffusionGemma folder, served by its serial worker instead of the batch engine; the
    tokenizer, template and chat features are built as for any chat model."""
    path = resolved.path
    try:
        tokenizer = Tokenizer.from_pretrained_dir(path)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    template = load_chat_template(override_source=options.chat_template, override_file=options.chat_template_file,
                                  gguf_metadata=None, model_dir=path)
    if engine_config.speculative.is_enabled or options.adapters:
        raise ValueError(f"{path} is a block-diffusion model: speculative decoding and LoRA adapters do not apply")
    started = time.monotonic()
    model = load_block_diffusion(path, options.diffusion, device=options.device, dtype=options.torch_dtype())
    text_config = model.config.text_config
    loaded = LoadedModel(model, model.config.to_dict(), path, None, path)
    log.info("Model loaded: %s (block diffusion, %s, canvas %d tokens, sampler %s) in %.1f s", resolved.name,
             options.torch_dtype(), model.config.canvas_length, options.diffusion.sampler, time.monotonic() - started)
    features = build_chat_features(resolved.name, loaded, tokenizer, template, options.chat)
    engine_config = replace(engine_config, max_num_seqs=1, enable_prefix_caching=False)
    vision = vision_inputs(path, model)
    worker = BlockDiffusionWorker(model, engine_config, options.diffusion,
                                  context_length=int(text_config.max_position_embeddings),
                                  eos_token_ids=tokenizer.eos_token_ids, device=options.device, vision=vision)
    if options.warmup:
        log.info("warmup done in %.2f s (one block, one denoising step)", worker.warm())
    worker.start()
    marker = tokenizer.decode([vision.image_token_id], skip_special_tokens=False) if vision is not None else None
    log.info("block diffusion: image input %s", f"on (marker {marker!r})" if marker else "off (no vision tower)")
    return ServedModel(resolved.name, loaded, tokenizer, template, EngineClient(worker), engine_config,  # type: ignore[arg-type]
                       features, image_marker=marker)


def _on_engine_thread(build: Callable[[], ServedModel]) -> ServedModel:
    """Run `build` on a new thread that then becomes the engine loop; errors come back here."""
    result: list[ServedModel | BaseException] = []
    ready = threading.Event()

    def main() -> None:
        try:
            served = build()
            served.engine.core.adopt_current_thread()  # stop() may join it as soon as we return
            result.append(served)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            result.append(exc)
            return
        finally:
            ready.set()
        served.engine.core.run_on_this_thread()

    threading.Thread(target=main, name="mlxcel-engine", daemon=True).start()
    ready.wait()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]
