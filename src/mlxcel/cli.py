"""Command line: `mlxcel serve`, `mlxcel-server` (one startup path, A1), `mlxcel generate` (A10) and
`mlxcel perplexity` (issue 27).

The commands only: their options are read by `command_line.py` (the settings table's flags and
mirrors into frozen configs); `serve` hands them to `startup.run`, `cluster` to
`cluster.command`, `generate --audio` to `audio_cli`. `mlxcel serve` shows `--n-parallel` /
`--draft-model` first, `mlxcel-server` shows `--parallel` / `--model-draft`; both accept every
spelling.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from mlxcel.command_line import (
    GENERATE_OPTIONS, LOG_FORMAT, OPTIONS, PERPLEXITY_OPTIONS, ServeSettings, generate_parser, generate_settings,
    perplexity_parser, perplexity_settings, resolve_device, resolve_values, serve_parser, serve_settings,
)
from mlxcel.config import EngineConfig
from mlxcel.env import Environment

if TYPE_CHECKING:
    from mlxcel.api.generation import Prompt
    from mlxcel.serving.served_model import ServedModel

log = logging.getLogger("mlxcel")


# ---- serve ----

def run_serve(settings: ServeSettings) -> int:
    """`mlxcel serve` once its settings are valid: the one startup path (A6), then serve (A7)."""
    from mlxcel.startup import run

    return run(settings)


# ---- generate ----

async def _generate(served: ServedModel, values: dict[str, Any], out: TextIO, err: TextIO) -> None:
    from mlxcel.api.context import ApiContext
    from mlxcel.api.generation import Generation, GenerationParams
    from mlxcel.types import SamplingParams

    ctx = ApiContext(served.name, served.engine, served.tokenizer, served.chat_template, served.context_size,
                     int(time.time()), served.features, lora=served.lora)
    prompt = _generate_prompt(served, values["prompt"], values["chat"])
    sampling = SamplingParams(temperature=values["temperature"], seed=values["seed"], max_tokens=values["max_tokens"])
    generation = Generation.start(ctx, [prompt], GenerationParams(sampling), request_id="generate")
    async for delta in generation.stream():
        out.write(delta.text)
        out.flush()
    if out.isatty():
        out.write("\n")  # keep the shell prompt off the last line; a pipe gets the text alone
    result = generation.results()[0]
    t = result.timings
    err.write(f"prompt: {result.num_prompt_tokens} tokens, {result.num_prompt_tokens / max(t.prefill_s, 1e-9):.1f} "
              f"tokens/s | generation: {result.num_completion_tokens} tokens, "
              f"{max(result.num_completion_tokens - 1, 0) / max(t.decode_s, 1e-9):.1f} tokens/s\n")


def _generate_prompt(served: ServedModel, text: str, chat: bool) -> Prompt:
    from mlxcel.api.generation import Prompt

    if not chat:
        return Prompt(tuple(served.tokenizer.encode(text, add_special_tokens=True)), text)
    if served.chat_template is None:
        raise ValueError("--chat: this model has no chat template (pass --chat-template)")
    rendered = served.chat_template.render([{"role": "user", "content": text}], add_generation_prompt=True)
    return Prompt(tuple(served.tokenizer.encode(rendered, add_special_tokens=False)), rendered)



def run_generate(values: dict[str, Any], environment: Environment) -> int:
    """One-shot generation: generated text to stdout, prompt and generation speed to stderr."""
    logging.basicConfig(level=logging.DEBUG if values["verbose"] else logging.WARNING, format=LOG_FORMAT, force=True)
    if values["audio"] or values["output_audio"] or values["realtime_stt"] or values["realtime_tts"]:
        from mlxcel.audio_cli import run_audio_generate

        return run_audio_generate(values, environment)
    if not values["prompt"]:
        log.error("generate: -p/--prompt is required")
        return 2
    from mlxcel.api.errors import ApiError
    from mlxcel.loading import ModelLoadError, resolve_model
    from mlxcel.serving.chat_model import start_served_model
    from mlxcel.serving.served_model import AdapterError

    try:
        resolved = resolve_model(values["model"], models_dir=values["models_dir"], default_org=values["default_org"])
        served = start_served_model(resolved, *generate_settings(values))
    except AdapterError as exc:  # as serve: an adapter that does not fit the model is a usage error
        log.error("cannot start: LoRA adapter %s", exc)
        return 2
    except (ModelLoadError, ValueError, OSError) as exc:
        log.error("cannot load the model: %s", exc)
        return 1
    try:
        asyncio.run(_generate(served, values, sys.stdout, sys.stderr))
    except (ApiError, ValueError) as exc:
        log.error("generate: %s", exc)
        return 1
    finally:
        served.close()
    return 0


# ---- perplexity ----

def run_perplexity(values: dict[str, Any]) -> int:
    """`mlxcel perplexity` (issue 27): the model on the server's decode path, then llama-perplexity's numbers."""
    logging.basicConfig(level=logging.DEBUG if values["verbose"] else logging.WARNING, format=LOG_FORMAT, force=True)
    from mlxcel.loading import ModelLoadError, resolve_model
    from mlxcel.perplexity import PerplexityError, PerplexityRun, engine_chunk_logits, perplexity_main, run_context
    from mlxcel.serving.chat_model import start_served_model

    run = PerplexityRun(n_ctx=values["ppl_ctx"], num_chunks=values["chunks"], base_file=values["kl_divergence_base"],
                        is_kl_divergence=values["kl_divergence"])
    try:
        n_ctx = run_context(run)
        text = None if run.is_kl_divergence or values["text_file"] is None else (
            Path(values["text_file"]).read_text(encoding="utf-8", errors="replace"))
        resolved = resolve_model(values["model"], models_dir=values["models_dir"], default_org=values["default_org"])
        served = start_served_model(resolved, *perplexity_settings(values, n_ctx))
    except (PerplexityError, ModelLoadError, ValueError, OSError) as exc:
        log.error("perplexity: %s", exc)
        return 1
    try:
        perplexity_main(run, served.tokenizer, text, engine_chunk_logits(served.engine.core))
    except (PerplexityError, OSError) as exc:
        log.error("perplexity: %s", exc)
        return 1
    finally:
        served.close()
    return 0


# ---- entry points ----

def _serve_main(prog: str, style: str, argv: Sequence[str]) -> int:
    parser = serve_parser(prog, style)
    namespace = parser.parse_args(argv)
    try:
        environment = Environment.read()
        settings = serve_settings(resolve_values(namespace, OPTIONS, environment), environment)
    except ValueError as exc:  # SettingError (flag or variable), a bad combination, an unreadable key file
        return startup_error(prog, exc)
    return run_serve(settings)


def startup_error(prog: str, exc: Exception) -> int:
    """A refused start: one line on stderr, exit status 2."""
    sys.stderr.write(f"{prog}: error: {exc}\n")
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """`mlxcel serve ...` or `mlxcel generate ...`."""
    args = list(sys.argv[1:] if argv is None else argv)
    commands = {"serve": "start the HTTP server", "generate": "generate text once from the command line",
                "cluster": "serve from N replicas on Ray Serve behind one endpoint (needs mlxcel[cluster])",
                "perplexity": "perplexity and KL divergence of a text, as llama-perplexity computes them"}
    if not args or args[0] in ("-h", "--help") or args[0] not in commands:
        usage = "\n".join(f"  {name:<10} {text}" for name, text in commands.items())
        stream = sys.stdout if args and args[0] in ("-h", "--help") else sys.stderr
        stream.write(f"usage: mlxcel <command> [options]\n\ncommands:\n{usage}\n\n"
                     "`mlxcel <command> --help` lists a command's options.\n")
        return 0 if stream is sys.stdout else 2
    if args[0] == "serve":
        return _serve_main("mlxcel serve", "serve", args[1:])
    if args[0] == "cluster":  # spec X; Ray is imported only once the cluster starts
        from mlxcel.cluster.command import cluster_main

        return cluster_main(args[1:])
    if args[0] == "perplexity":
        namespace = perplexity_parser("mlxcel perplexity").parse_args(args[1:])
        try:
            values = resolve_values(namespace, PERPLEXITY_OPTIONS + tuple(OPTIONS), Environment.read())
        except ValueError as exc:
            return startup_error("mlxcel perplexity", exc)
        return run_perplexity(values)
    parser = generate_parser("mlxcel generate")
    namespace = parser.parse_args(args[1:])
    try:
        environment = Environment.read()
        values = resolve_values(namespace, GENERATE_OPTIONS + tuple(OPTIONS), environment)
    except ValueError as exc:
        return startup_error("mlxcel generate", exc)
    return run_generate(values, environment)


def server_main(argv: Sequence[str] | None = None) -> int:
    """`mlxcel-server ...`: the same startup as `mlxcel serve`, llama-server spellings first."""
    return _serve_main("mlxcel-server", "server", list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
