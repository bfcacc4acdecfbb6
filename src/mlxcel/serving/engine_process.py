"""The engine process (issue 25): the engine core (weights, scheduler, KV, sampler) in a spawned child,
fed and drained once per engine step over a pipe (`engine.remote`), while the API process keeps HTTP,
templates and detokenization. `start_engine_process` runs in the API process: it spawns the child and
returns a `ServedModel` whose engine is the child's `RemoteCore`; `engine_process_main` is the child's
entry point (the spawn target, imported by this module path), which builds the model as a one-process
server does (`served_model.build_served`) and runs it.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch

from mlxcel.config import EngineConfig
from mlxcel.engine.client import EngineClient
from mlxcel.engine.loop import EngineCore
from mlxcel.loading import Checkpoint, LoadedModel, ResolvedModel, open_checkpoint
from mlxcel.lora_registry import LoraRegistry
from mlxcel.serving.served_model import (
    RuntimeOptions, ServedModel, build_chat_features, build_served, load_tokenizer, warmup,
)
from mlxcel.text.chat_template import ChatTemplate, load_chat_template
from mlxcel.text.tokenizer import Tokenizer
from mlxcel.types import ImagePrompter

log = logging.getLogger(__name__)


def start_engine_process(resolved: ResolvedModel, checkpoint: Checkpoint, tokenizer: Tokenizer,
                         template: ChatTemplate | None, options: RuntimeOptions, engine_config: EngineConfig,
                         draft: ResolvedModel | None) -> ServedModel:
    """Issue 25: the engine core (weights, scheduler, KV, sampler) in a spawned child process that loads
    and warms up the model; this process keeps the tokenizer, template and chat features."""
    import multiprocessing

    from mlxcel.engine.remote import wait_ready

    context = multiprocessing.get_context("spawn")
    root = logging.getLogger()
    log_format = next((h.formatter._fmt for h in root.handlers if h.formatter is not None), None)
    log_files = [h.baseFilename for h in root.handlers if isinstance(h, logging.FileHandler)]  # --log-file
    logs = (root.level, log_format, log_files)

    def spawn() -> tuple[BaseProcess, Connection]:
        """A new engine process and our end of its pipe: at startup, and after one died (issue 44)."""
        ours, theirs = context.Pipe()
        child = context.Process(target=engine_process_main, name="mlxcel-engine",
                                args=(theirs, resolved, options, engine_config, draft, logs))
        child.start()
        theirs.close()
        log.info("engine process: pid %d, loading the model", child.pid)
        return child, ours

    process, ours = spawn()
    try:
        core = wait_ready(process, ours, respawn=spawn)
    except BaseException:  # a load error, or an interrupt while loading: the engine process goes too
        process.kill()
        process.join(5)
        raise
    info = core.info
    loaded = LoadedModel(None, checkpoint.config, checkpoint.path, checkpoint.gguf, checkpoint.model_dir,  # type: ignore[arg-type]
                         checkpoint.quant)
    features = build_chat_features(resolved.name, loaded, tokenizer, template, options.chat)
    prompter = unpickle_prompter(info.image_prompter, tokenizer) if info.image_prompter else None
    log.info("engine process: pid %d ready (the API process keeps HTTP, templates and detokenization)", info.pid)
    return ServedModel(resolved.name, loaded, tokenizer, template, EngineClient(core), info.config,  # type: ignore[arg-type]
                       features, LoraRegistry(list(info.lora_adapters)), info.mtp,
                       weights=loaded.weights_info(),  # the resident bytes are the engine process's
                       image_marker=prompter.marker if prompter else None, image_prompter=prompter)


class _PrompterPickler(pickle.Pickler):
    """Pickles an ImagePrompter with its tokenizer as a reference: the API process has its own."""

    def __init__(self, file: io.BytesIO, tokenizer: Tokenizer) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._tokenizer = tokenizer

    def persistent_id(self, obj: object) -> str | None:
        return "tokenizer" if obj is self._tokenizer else None


class _PrompterUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tokenizer: Tokenizer) -> None:
        super().__init__(file)
        self._tokenizer = tokenizer

    def persistent_load(self, pid: object) -> Tokenizer:
        if pid != "tokenizer":
            raise pickle.UnpicklingError(f"unknown reference {pid!r}")
        return self._tokenizer


def pickle_prompter(prompter: ImagePrompter, tokenizer: Tokenizer) -> bytes:
    """Issue 43: the engine process's image prompter (the processor settings the model was loaded with, an
    mmproj file's included) for the API process, which runs it before the engine's length check."""
    buffer = io.BytesIO()
    _PrompterPickler(buffer, tokenizer).dump(prompter)
    return buffer.getvalue()


def _handed_prompter(served: ServedModel, tokenizer: Tokenizer) -> bytes | None:
    """The engine process's prompter for the API process; None (images refused, logged) where it cannot cross."""
    if served.image_prompter is None:
        return None
    try:
        return pickle_prompter(served.image_prompter, tokenizer)
    except Exception as exc:  # noqa: BLE001 - the model still serves text
        log.warning("engine process: the image processor cannot be handed to the API process (%r); image input "
                    "is off with --engine-process on", exc)
        return None


def unpickle_prompter(data: bytes, tokenizer: Tokenizer) -> ImagePrompter:
    return _PrompterUnpickler(io.BytesIO(data), tokenizer).load()


def engine_process_main(conn: object, resolved: ResolvedModel, options: RuntimeOptions, engine_config: EngineConfig,
                        draft: ResolvedModel | None, logs: tuple[int, str | None, list[str]]) -> None:
    """The engine process (issue 25): load, build the EngineCore and run it; the API process drives it
    over `conn`. SIGINT is the API process's to handle (it stops us over the pipe)."""
    import signal

    from mlxcel.chat.grammar import compile_copies_with
    from mlxcel.engine.remote import EngineInfo, exit_now, run_engine_process

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    level, log_format, log_files = logs
    handlers: list[logging.Handler] = [logging.StreamHandler(), *(logging.FileHandler(f, encoding="utf-8") for f in log_files)]
    logging.basicConfig(level=level, format=log_format or "%(levelname)s %(name)s: %(message)s", handlers=handlers,
                        force=True)
    if options.threads > 0:
        torch.set_num_threads(options.threads)
    box: list[ServedModel] = []

    def build() -> tuple[EngineCore, EngineInfo]:
        checkpoint = open_checkpoint(resolved.path)
        tokenizer = load_tokenizer(checkpoint)
        draft_checkpoint = open_checkpoint(draft.path) if draft is not None else None
        template = load_chat_template(
            override_source=options.chat_template, override_file=options.chat_template_file,
            gguf_metadata=checkpoint.gguf.metadata if checkpoint.gguf else None, model_dir=checkpoint.model_dir)
        served = build_served(resolved, checkpoint, tokenizer, template, options, engine_config, draft_checkpoint)
        compile_copies_with(served.features.grammar)  # grammar processors handed over are rebuilt over it
        box.append(served)
        core = served.engine.core
        prompter = _handed_prompter(served, tokenizer)
        info = EngineInfo(served.engine_config, core.slot_context, core.memory_budget, core.eos_token_ids,
                          tuple((e["path"], e["scale"]) for e in served.lora.list()), served.mtp, os.getpid(),
                          prompter)
        return core, info

    def warm() -> None:
        if options.warmup:
            warmup(box[0])

    exit_now(run_engine_process(conn, build, warm))  # type: ignore[arg-type]
