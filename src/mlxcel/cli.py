"""Command line: `mlxcel serve`, `mlxcel-server` (one startup path, A1) and `mlxcel generate` (A10).

Options are data (`OPTIONS`): llama-server spellings with aliases, a type, a default and an
environment mirror (`LLAMA_ARG_*`, A10). A flag on the command line wins over its mirror,
which wins over the default. `mlxcel serve` shows `--n-parallel` / `--draft-model` first,
`mlxcel-server` shows `--parallel` / `--model-draft`; both accept every spelling.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from mlxcel.config import CACHE_TYPES, DECODE_STEPS, EngineConfig
from mlxcel.env import Environment, EnvError, parse_bool
from mlxcel.server.config import ServerConfig, default_responses_db

if TYPE_CHECKING:  # torch-heavy modules load lazily, so --help stays fast
    from mlxcel.text.chat_plan import FeatureSettings
    from mlxcel.api.generation import Prompt
    from mlxcel.loading import ResolvedModel
    from mlxcel.media.limits import MediaPolicy
    from mlxcel.runtime import RuntimeOptions, ServedModel
    from mlxcel.side_models import ProcessPlan, SideModelOptions, SideModels
    from mlxcel.audio_models import AudioOptions
    from mlxcel.server.realtime import RealtimeService
    from mlxcel.server.state import ServerState

log = logging.getLogger("mlxcel")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_SIZE_UNITS = {"": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
               "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """A byte count: 33554432, 32M, 32MiB, 1G (binary units)."""
    value = text.strip().lower()
    digits = value.rstrip("kmgib")
    unit = value[len(digits):]
    if not digits.isdigit() or unit not in _SIZE_UNITS:
        raise ValueError(f"expected a size such as 32M or 33554432, not {text!r}")
    return int(digits) * _SIZE_UNITS[unit]


def parse_bool_arg(text: str) -> bool:
    try:
        return parse_bool(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class Option:
    """One command-line option. `names[0]` is shown first unless `serve_names` reorders it."""

    names: tuple[str, ...]
    dest: str
    help: str
    parse: Callable[[str], Any] = str
    default: Any = None
    kind: str = "value"  # value | on (a flag that sets True) | off (a flag that sets False) | bool (--x[=BOOL])
    env: str | None = None  # the environment mirror, read from the startup snapshot
    metavar: str | None = None
    group: str = "server"
    serve_names: tuple[str, ...] | None = None
    choices: tuple[str, ...] | None = None


OPTIONS: tuple[Option, ...] = (
    # model
    Option(("-m", "--model"), "model", "GGUF file, Hugging Face folder, owner/name repo id or bare name "
           "(read as $MLXCEL_DEFAULT_ORG/NAME); default: the embedded SmolLM2-135M-Instruct",
           env="LLAMA_ARG_MODEL", metavar="MODEL", group="model"),
    Option(("-a", "--alias"), "alias", "model id reported by /v1/models and responses", env="LLAMA_ARG_ALIAS",
           metavar="NAME", group="model"),
    Option(("--models-dir",), "models_dir", "where downloaded models are stored", parse=Path,
           env="MLXCEL_MODELS_DIR", metavar="PATH", group="model"),
    Option(("--model-draft", "-md", "--draft-model"), "draft_model", "draft model for speculative decoding (not in this build: startup refuses it)",
           env="LLAMA_ARG_MODEL_DRAFT", metavar="MODEL", group="model",
           serve_names=("--draft-model", "-md", "--model-draft")),
    Option(("--chat-template",), "chat_template", "chat template: Jinja source or a built-in name "
           "(default: the model's own)", env="LLAMA_ARG_CHAT_TEMPLATE", metavar="TEMPLATE", group="model"),
    Option(("--chat-template-file",), "chat_template_file", "read the chat template from a file", parse=Path,
           env="LLAMA_ARG_CHAT_TEMPLATE_FILE", metavar="PATH", group="model"),
    Option(("--device", "-dev"), "device", "torch device: auto, cpu, cuda, cuda:N", default="auto",
           env="LLAMA_ARG_DEVICE", metavar="DEVICE", group="model"),
    Option(("--dtype",), "dtype", "weight and KV dtype (auto = float32 on CPU, bfloat16 on CUDA)", default="auto",
           env="LLAMA_ARG_DTYPE", group="model", choices=("auto", "float32", "bfloat16", "float16")),
    Option(("--no-warmup",), "warmup", "skip the warmup before listening (decode-step compile or capture, a short prompt and 8 tokens)", default=True, kind="off",
           group="model"),
    Option(("-t", "--threads"), "threads", "CPU threads for the model (0 = torch's default: every core)",
           parse=int, default=0, env="LLAMA_ARG_THREADS", metavar="N", group="model"),
    Option(("--quantize",), "quantize", "CPU decode matmuls: auto = weight-only 4-bit (where the checkpoint is "
           "4-bit) or int8; off = plain --dtype", default="auto", env="MLXCEL_QUANTIZE", group="model",
           choices=("auto", "off")),
    # chat behaviour (S, R, Q)
    Option(("--reasoning-format",), "reasoning_format", "where reasoning goes: none (in the content), deepseek / "
           "auto (reasoning_content), deepseek-legacy (both)", default="auto", env="LLAMA_ARG_THINK", group="chat",
           choices=("none", "deepseek", "deepseek-legacy", "auto")),
    Option(("--reasoning-budget",), "reasoning_budget", "reasoning tokens before </think> is forced: -1 unlimited, "
           "0 none (requests may override)", default="-1", env="LLAMA_ARG_REASONING_BUDGET", metavar="N",
           group="chat"),
    Option(("--chat-template-kwargs",), "chat_template_kwargs", "default chat-template kwargs, a JSON object; "
           "merged per key over LLAMA_ARG_CHAT_TEMPLATE_KWARGS", metavar="JSON", group="chat"),
    Option(("--skip-chat-parsing",), "skip_chat_parsing", "return generated text as is: no reasoning or tool-call "
           "parsing", default=False, kind="on", env="LLAMA_ARG_SKIP_CHAT_PARSING", group="chat"),
    # engine
    Option(("--parallel", "-np", "--n-parallel"), "parallel", "request slots served at once", parse=int, default=4,
           env="LLAMA_ARG_N_PARALLEL", metavar="N", group="engine", serve_names=("--n-parallel", "-np", "--parallel")),
    Option(("-c", "--ctx-size"), "ctx_size", "total context tokens over all slots (0 = the model's, per slot)",
           parse=int, default=0, env="LLAMA_ARG_CTX_SIZE", metavar="N", group="engine"),
    Option(("-b", "--batch-size"), "batch_size", "most tokens one engine step may compute", parse=int, default=2048,
           env="LLAMA_ARG_BATCH", metavar="N", group="engine"),
    Option(("-ub", "--ubatch-size"), "ubatch_size", "prefill chunk: most prompt tokens per step", parse=int,
           default=512, env="LLAMA_ARG_UBATCH", metavar="N", group="engine"),
    Option(("--max-queue-depth",), "max_queue_depth", "waiting requests before 503 + Retry-After", parse=int,
           default=64, env="LLAMA_ARG_MAX_QUEUE_DEPTH", metavar="N", group="engine"),
    Option(("--no-prompt-cache", "--no-cache-prompt"), "prompt_cache", "turn prefix caching (APC) off",
           default=True, kind="off", group="engine"),
    Option(("--apc-enabled",), "prompt_cache", "automatic prefix caching on or off (--apc-enabled=false)",
           parse=parse_bool_arg, default=True, kind="bool", env="LLAMA_ARG_APC_ENABLED", group="engine"),
    Option(("--max-kv-size",), "max_kv_size", "keep only the newest N tokens live (0 = off, else 64..2^31-1)",
           parse=int, default=0, env="LLAMA_ARG_MAX_KV_SIZE", metavar="N", group="engine"),
    Option(("--kv-cache-memory",), "kv_cache_memory", "cap the KV pool at this many bytes (e.g. 512M; 0 = room "
           "for every slot's full context); a smaller pool preempts and recomputes under pressure", parse=parse_size,
           default=0, env="MLXCEL_KV_CACHE_MEMORY", metavar="SIZE", group="engine"),
    Option(("-ctk", "--cache-type-k"), "cache_type_k", "KV cache element type for keys: f32, bf16 or f16",
           default="bf16", env="LLAMA_ARG_CACHE_TYPE_K", group="engine", choices=CACHE_TYPES,
           serve_names=("--cache-type-k", "-ctk")),
    Option(("-ctv", "--cache-type-v"), "cache_type_v", "KV cache element type for values: f32, bf16 or f16",
           default="bf16", env="LLAMA_ARG_CACHE_TYPE_V", group="engine", choices=CACHE_TYPES,
           serve_names=("--cache-type-v", "-ctv")),
    Option(("--decode-step",), "decode_step", "how decode steps run: auto = compiled (torch.compile) on CPU and "
           "CUDA graphs on CUDA; compile, cuda-graph or eager", default="auto", env="MLXCEL_DECODE_STEP",
           group="engine", choices=DECODE_STEPS),
    Option(("--no-compile",), "no_compile", "run decode steps eagerly, op by op (as --decode-step eager): no "
           "compile time at startup", default=False, kind="on", env="MLXCEL_NO_COMPILE", group="engine"),
    Option(("--decode-timeout",), "decode_timeout", "abort a request that produces no token for this long "
           "(not applied to prefill)", parse=float, default=600.0, env="LLAMA_ARG_DECODE_TIMEOUT",
           metavar="SECONDS", group="engine"),
    Option(("--slot-save-path",), "slot_save_path", "folder for POST /slots/ID?action=save|restore",
           env="LLAMA_ARG_SLOT_SAVE_PATH", metavar="PATH", group="engine"),
    # server
    Option(("--host",), "host", "address to bind; a path ending in .sock serves a Unix socket", default="127.0.0.1",
           env="LLAMA_ARG_HOST"),
    Option(("--port",), "port", "TCP port (0 = any free port; the real one is logged)", parse=int, default=8080,
           env="LLAMA_ARG_PORT"),
    Option(("--api-key",), "api_key", "require this key (several: comma-separated) as Bearer token or X-Api-Key",
           env="LLAMA_API_KEY", metavar="KEY"),
    Option(("--api-key-file",), "api_key_file", "read API keys from a file, one per line", parse=Path,
           metavar="PATH"),
    Option(("-to", "--timeout"), "timeout", "HTTP read/write timeout", parse=float, default=3600.0,
           env="LLAMA_ARG_TIMEOUT", metavar="SECONDS"),
    Option(("--max-body-size",), "max_body_size", "largest request body (e.g. 32M); larger ones get 413",
           parse=parse_size, default=32 << 20, env="LLAMA_ARG_MAX_BODY_SIZE", metavar="SIZE"),
    Option(("--sse-keepalive",), "sse_keepalive", "seconds of silence before an SSE keepalive comment",
           parse=float, default=15.0, metavar="SECONDS"),
    Option(("--slots",), "endpoint_slots", "serve /slots (default: on)", default=True, kind="on",
           env="LLAMA_ARG_ENDPOINT_SLOTS"),
    Option(("--no-slots",), "endpoint_slots", "do not serve /slots", default=True, kind="off"),
    Option(("--props",), "endpoint_props", "serve /props", default=False, kind="on", env="LLAMA_ARG_ENDPOINT_PROPS"),
    Option(("--metrics",), "endpoint_metrics", "serve Prometheus /metrics", default=False, kind="on",
           env="LLAMA_ARG_ENDPOINT_METRICS"),
    Option(("--webui",), "webui", "serve the admin web UI at /webui/ and its control plane /ui-api/v1 (without -m "
           "the server starts model-less; loopback only unless --api-key and TLS are given)", default=False,
           kind="on", env="MLXCEL_WEBUI"),
    Option(("--api-prefix",), "api_prefix", "mount every route under this prefix (e.g. /llm)", default="",
           env="LLAMA_ARG_API_PREFIX", metavar="PREFIX"),
    Option(("--cors-origins", "--allowed-origins"), "cors_origins", "browser origins allowed to call the server "
           "(comma-separated, or *); other origins get 403; clients sending no Origin are accepted",
           env="MLXCEL_CORS_ORIGINS", metavar="ORIGINS"),
    Option(("--ssl-key-file",), "ssl_key_file", "PEM private key: serve HTTPS", parse=Path,
           env="LLAMA_ARG_SSL_KEY_FILE", metavar="PATH"),
    Option(("--ssl-cert-file",), "ssl_cert_file", "PEM certificate chain: serve HTTPS", parse=Path,
           env="LLAMA_ARG_SSL_CERT_FILE", metavar="PATH"),
    Option(("--responses-db",), "responses_db", "SQLite file keeping stored /v1/responses (default: "
           "<models dir or ~/.cache/mlxcel>/responses.sqlite3)", parse=Path, env="MLXCEL_RESPONSES_DB",
           metavar="PATH"),
    Option(("--stream-buffer-streams",), "stream_buffer_streams", "finished resumable streams kept for "
           "GET /v1/stream (F6)", parse=int, default=64, env="MLXCEL_STREAM_BUFFER_STREAMS", metavar="N"),
    Option(("--stream-buffer-bytes",), "stream_buffer_bytes", "SSE events kept per resumable stream (e.g. 4M); "
           "older events are dropped first", parse=parse_size, default=4 << 20, env="MLXCEL_STREAM_BUFFER_BYTES",
           metavar="SIZE"),
    Option(("--stream-buffer-ttl",), "stream_buffer_ttl", "seconds a resumable stream is kept after its last "
           "event; a running one nobody reads is cancelled then", parse=float, default=300.0,
           env="MLXCEL_STREAM_BUFFER_TTL", metavar="SECONDS"),
    # embeddings and rerank (spec I)
    Option(("--embedding-model",), "embedding_model", "embedding checkpoint served beside the chat model on "
           "/v1/embeddings, /embedding(s)", env="LLAMA_ARG_EMBEDDING_MODEL", metavar="MODEL", group="side"),
    Option(("--reranker-model",), "reranker_model", "reranker served on /v1/rerank: a 1-label sequence classifier, "
           "or a causal LM scored by yes/no (the same path as -m: a rerank-only process)",
           env="LLAMA_ARG_RERANKER_MODEL", metavar="MODEL", group="side"),
    Option(("--embedding-batch-size",), "embedding_batch_size", "inputs per embedding forward", parse=int,
           default=16, env="LLAMA_ARG_EMBEDDING_BATCH_SIZE", metavar="N", group="side"),
    Option(("--rerank-batch-size",), "rerank_batch_size", "pairs per rerank forward (0 = 8 text pairs)",
           parse=int, default=0, env="LLAMA_ARG_RERANK_BATCH_SIZE", metavar="N", group="side"),
    Option(("--embedding-queue-depth",), "embedding_queue_depth", "requests waiting per embedding/rerank worker "
           "before 503", parse=int, default=8, env="LLAMA_ARG_EMBEDDING_QUEUE_DEPTH", metavar="N", group="side"),
    Option(("--embedding-request-timeout-secs",), "embedding_request_timeout", "embedding/rerank request "
           "deadline before 504", parse=float, default=120.0, env="LLAMA_ARG_EMBEDDING_REQUEST_TIMEOUT_SECS",
           metavar="SECONDS", group="side"),
    Option(("--pooling",), "pooling", "override the checkpoint's pooling", env="LLAMA_ARG_POOLING", group="side",
           choices=("mean", "cls", "last", "none")),
    Option(("--embd-normalize",), "embd_normalize", "override the normalization: -1 none, 0 int16 max-abs, "
           "1 taxicab, 2 euclidean, >2 p-norm", parse=int, env="LLAMA_ARG_EMBD_NORMALIZE", metavar="N",
           group="side"),
    Option(("--embedding", "--embeddings"), "embeddings_mode", "restricted mode: serve embeddings only (needs an "
           "embedding model)", default=False, kind="on", env="LLAMA_ARG_EMBEDDINGS", group="side"),
    Option(("--rerank", "--reranking"), "reranking_mode", "restricted mode: serve reranking only (needs a "
           "reranker)", default=False, kind="on", env="LLAMA_ARG_RERANKING", group="side"),
    # media input (C2-C5)
    Option(("--media-path",), "media_path", "folder local media (file:// URLs, bare names) may be read from; "
           "without it local media is refused", parse=Path, env="LLAMA_ARG_MEDIA_PATH", metavar="DIR",
           group="media"),
    Option(("--max-image-payload-size",), "max_image_payload_size", "largest image payload (e.g. 20M; "
           "default 20M)", parse=parse_size, env="LLAMA_ARG_MAX_IMAGE_PAYLOAD_SIZE", metavar="SIZE", group="media"),
    Option(("--max-images",), "max_images", "most images per request, video frames included (default 32)",
           parse=int, env="LLAMA_ARG_MAX_IMAGES", metavar="N", group="media"),
    Option(("--video-max-frames",), "video_max_frames", "frames kept per video block (default 16)", parse=int,
           env="MLXCEL_VIDEO_MAX_FRAMES", metavar="N", group="media"),
    Option(("--video-fps",), "video_fps", "video sampling rate when a block gives none (default 2.0)",
           parse=float, env="MLXCEL_VIDEO_FPS", metavar="FPS", group="media"),
    # audio-only processes (spec G)
    Option(("--audio-queue-depth",), "audio_queue_depth", "audio requests waiting before 503", parse=int,
           default=8, env="MLXCEL_AUDIO_QUEUE_DEPTH", metavar="N", group="audio"),
    Option(("--audio-request-timeout-secs",), "audio_request_timeout", "audio request deadline before 504",
           parse=float, default=120.0, env="MLXCEL_AUDIO_REQUEST_TIMEOUT_SECS", metavar="SECONDS", group="audio"),
    Option(("--audio-max-upload-size",), "audio_max_upload_size", "largest audio upload before 413 (default 25M)",
           parse=parse_size, env="MLXCEL_AUDIO_MAX_UPLOAD_SIZE", metavar="SIZE", group="audio"),
    Option(("--audio-max-duration-secs",), "audio_max_duration", "longest audio accepted for transcription "
           "before 400", parse=float, default=600.0, env="MLXCEL_AUDIO_MAX_DURATION_SECS", metavar="SECONDS",
           group="audio"),
    Option(("--audio-beam-size",), "audio_beam_size", "Whisper beam size", parse=int, default=5,
           env="MLXCEL_AUDIO_BEAM_SIZE", metavar="N", group="audio"),
    # realtime voice sessions (spec H)
    Option(("--realtime-stt",), "realtime_stt", "with --realtime-tts: serve /v1/realtime as a cascade of this "
           "Whisper checkpoint, -m (the chat model) and the voice; chat routes then answer 501",
           env="MLXCEL_REALTIME_STT", metavar="MODEL", group="realtime"),
    Option(("--realtime-tts",), "realtime_tts", "the Kokoro or Piper voice of the /v1/realtime cascade",
           env="MLXCEL_REALTIME_TTS", metavar="MODEL", group="realtime"),
    # logging
    Option(("-v", "--verbose"), "verbose", "debug logging", default=False, kind="on", group="logging"),
    Option(("--log-file",), "log_file", "also write the log to this file", parse=Path, env="LLAMA_LOG_FILE",
           metavar="PATH", group="logging"),
)

GENERATE_OPTIONS: tuple[Option, ...] = (
    Option(("-p", "--prompt"), "prompt", "the prompt text (required)", metavar="TEXT", group="generate"),
    Option(("--chat",), "chat", "wrap the prompt as a user message in the chat template", default=False,
           kind="on", group="generate"),
    Option(("-n", "--max-tokens"), "max_tokens", "most tokens to generate", parse=int, default=256, metavar="N",
           group="generate"),
    Option(("--temp",), "temperature", "sampling temperature (0 = greedy)", parse=float, default=0.0, metavar="T",
           group="generate"),
    Option(("--seed",), "seed", "sampling seed", parse=int, metavar="S", group="generate"),
    Option(("--audio",), "audio", "audio file in: transcribed by a Whisper -m, or the spoken turn of a "
           "--realtime-stt/--realtime-tts cascade", parse=Path, metavar="WAV", group="generate"),
    Option(("--output-audio",), "output_audio", "write speech here: the -p text spoken by a Kokoro/Piper -m, or "
           "the cascade's spoken answer", parse=Path, metavar="WAV", group="generate"),
)
_GENERATE_SHARED = ("model", "models_dir", "chat_template", "chat_template_file", "device", "dtype", "ctx_size",
                    "verbose", "realtime_stt", "realtime_tts", "audio_beam_size", "threads")
GROUP_TITLES = {"model": "model", "chat": "chat: reasoning, tools, templates", "engine": "engine",
                "server": "HTTP server", "logging": "logging",
                "generate": "generation", "side": "embeddings and rerank", "media": "media input",
                "audio": "audio-only processes (-m a Whisper, Kokoro or Piper checkpoint)",
                "realtime": "realtime voice (/v1/realtime WebSocket)"}


# ---- parsing ----

class HelpFormatter(argparse.HelpFormatter):
    """`--n-parallel, -np, --parallel N` instead of repeating the metavar after each spelling."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=40, width=110)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        metavar = self._format_args(action, self._get_default_metavar_for_optional(action))
        return f"{', '.join(action.option_strings)} {metavar}"


def _names(option: Option, style: str) -> tuple[str, ...]:
    return option.serve_names if style == "serve" and option.serve_names else option.names


def _help_text(option: Option) -> str:
    extra = []
    if option.kind == "value" and option.default not in (None, ""):
        extra.append(f"default: {option.default}")
    if option.env:
        extra.append(f"env: {option.env}")
    return f"{option.help} ({'; '.join(extra)})" if extra else option.help


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option], style: str) -> None:
    groups: dict[str, argparse._ArgumentGroup] = {}
    for option in options:
        group = groups.get(option.group) or parser.add_argument_group(GROUP_TITLES[option.group])
        groups[option.group] = group
        kwargs: dict[str, Any] = {"dest": option.dest, "help": _help_text(option), "default": argparse.SUPPRESS}
        if option.kind == "on":
            kwargs["action"] = "store_true"
        elif option.kind == "off":
            kwargs["action"] = "store_false"
        else:
            kwargs.update(type=option.parse, metavar=option.metavar, choices=option.choices)
            if option.kind == "bool":
                kwargs.update(nargs="?", const=True, metavar="BOOL")
        group.add_argument(*_names(option, style), **kwargs)


def resolve_values(namespace: argparse.Namespace, options: Sequence[Option], environment: Environment) -> dict[str, Any]:
    """Command line, else the environment mirror, else the default (A10: CLI wins)."""
    values: dict[str, Any] = dict(vars(namespace))
    for option in options:  # several options may share a dest (--no-slots / --slots): env after all CLI
        if option.dest not in values and option.env and option.env in environment.raw:
            values[option.dest] = _parse_env(option, environment.raw[option.env])
    for option in options:
        values.setdefault(option.dest, option.default)
    return values


def _parse_env(option: Option, text: str) -> Any:
    try:
        if option.kind in ("on", "off", "bool"):
            is_on = parse_bool(text)
            return (not is_on) if option.kind == "off" else is_on
        return option.parse(text)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise EnvError(f"environment variable {option.env}={text!r} is invalid: {exc}") from None


# ---- serve ----

@dataclass(frozen=True, slots=True)
class ServeSettings:
    """Everything `serve` needs, validated; built by `serve_settings`."""

    model: str | None
    models_dir: Path | None
    default_org: str
    draft_model: str | None
    runtime: RuntimeOptions
    engine: EngineConfig
    server: ServerConfig
    verbose: bool = False
    log_file: Path | None = None
    api_key_source: str = "none"
    side: SideModelOptions | None = None  # embedding and rerank providers (spec I); None = none
    media: MediaPolicy | None = None  # C2-C5; None = the defaults (no --media-path)
    audio: AudioOptions | None = None  # spec G; None = the defaults
    realtime_stt: str | None = None  # spec H: the cascade's Whisper and voice; both or neither
    realtime_tts: str | None = None


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _api_keys(values: dict[str, Any]) -> tuple[tuple[str, ...], str]:
    from mlxcel.server.auth import read_api_key_file, split_keys

    keys = split_keys(values["api_key"])
    source = "--api-key / LLAMA_API_KEY" if keys else "none"
    if values["api_key_file"] is not None:
        keys += read_api_key_file(values["api_key_file"])
        source = "--api-key-file" if source == "none" else f"{source} and --api-key-file"
    return tuple(keys), source


def serve_settings(values: dict[str, Any], environment: Environment) -> ServeSettings:
    """Validate option values into configs; raises ValueError with a message naming the flag."""
    from mlxcel.runtime import RuntimeOptions

    keys, source = _api_keys(values)
    runtime = RuntimeOptions(device=resolve_device(values["device"]), dtype=values["dtype"],
                             chat_template=values["chat_template"], chat_template_file=values["chat_template_file"],
                             warmup=values["warmup"], chat=chat_settings(values, environment),
                             threads=values["threads"], quantize=values["quantize"])
    engine = EngineConfig(
        max_num_seqs=values["parallel"], ctx_size=values["ctx_size"],
        max_num_batched_tokens=_step_budget(values["batch_size"], values["ubatch_size"]),
        max_queue_depth=values["max_queue_depth"], enable_prefix_caching=values["prompt_cache"],
        max_kv_size=values["max_kv_size"], decode_timeout_s=values["decode_timeout"],
        kv_cache_bytes=values["kv_cache_memory"], slot_save_path=values["slot_save_path"],
        cache_type_k=values["cache_type_k"], cache_type_v=values["cache_type_v"],
        decode_step=_decode_step(values), compile_cache_dir=str(compile_cache_dir(values["models_dir"])))
    server = ServerConfig(
        host=values["host"], port=values["port"], api_keys=keys, alias=values["alias"], timeout_s=values["timeout"],
        max_body_bytes=values["max_body_size"], endpoint_slots=values["endpoint_slots"],
        endpoint_props=values["endpoint_props"], endpoint_metrics=values["endpoint_metrics"],
        sse_keepalive_s=values["sse_keepalive"], responses_db=_responses_db(values),
        stream_buffer_streams=values["stream_buffer_streams"], stream_buffer_bytes=values["stream_buffer_bytes"],
        stream_buffer_ttl_s=values["stream_buffer_ttl"],
        anthropic_pin_billing_stamp=environment["MLXCEL_ANTHROPIC_PIN_BILLING_STAMP"], **_browser_options(values, keys))
    return ServeSettings(values["model"], values["models_dir"], environment["MLXCEL_DEFAULT_ORG"],
                         values["draft_model"], runtime, engine, server, values["verbose"], values["log_file"], source,
                         _side_options(values, runtime), _media_policy(values, environment),
                         _audio_options(values, runtime), values["realtime_stt"], values["realtime_tts"])


def _browser_options(values: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """--webui (A5), --api-prefix (A11), --cors-origins (C6) and TLS; the web UI's listener rules are checked here."""
    from mlxcel.server.cors import parse_origins
    from mlxcel.server.webui import check_listener, new_session_key

    origins = parse_origins([values["cors_origins"]]) if values["cors_origins"] else None
    options = {"webui": values["webui"], "api_prefix": values["api_prefix"] or "", "cors_origins": origins,
               "ssl_keyfile": values["ssl_key_file"], "ssl_certfile": values["ssl_cert_file"]}
    check_listener(ServerConfig(host=values["host"], api_keys=keys, **options))
    if values["webui"] and not keys:
        options["ui_session_key"] = new_session_key()
    return options


def chat_settings(values: dict[str, Any], environment: Environment) -> FeatureSettings:
    """The chat features' server settings (S, R, Q, P), checked now: bad JSON or values refuse startup."""
    from mlxcel.text.chat_plan import FeatureSettings

    settings = FeatureSettings(
        reasoning_format=values["reasoning_format"], reasoning_budget=values["reasoning_budget"],
        chat_template_kwargs=values["chat_template_kwargs"],
        chat_template_kwargs_env=environment.raw.get("LLAMA_ARG_CHAT_TEMPLATE_KWARGS"),
        loop_detection=environment["MLXCEL_LOOP_DETECTION"],
        echo_max_bytes=environment["MLXCEL_REASONING_ECHO_MAX_BYTES"], skip_chat_parsing=values["skip_chat_parsing"])
    return settings.checked()


def _side_options(values: dict[str, Any], runtime: RuntimeOptions) -> SideModelOptions:
    from mlxcel.side_models import side_model_options

    return side_model_options(
        embedding_model=values["embedding_model"], reranker_model=values["reranker_model"],
        pooling=values["pooling"], embd_normalize=values["embd_normalize"],
        embedding_batch_size=values["embedding_batch_size"], rerank_batch_size_flag=values["rerank_batch_size"],
        queue_depth=values["embedding_queue_depth"], request_timeout_s=values["embedding_request_timeout"],
        is_embeddings_mode=values["embeddings_mode"], is_reranking_mode=values["reranking_mode"],
        device=runtime.device, dtype=str(runtime.torch_dtype()).removeprefix("torch."))


def _audio_options(values: dict[str, Any], runtime: RuntimeOptions) -> AudioOptions:
    from mlxcel.api.audio import AudioLimits
    from mlxcel.audio_models import AudioOptions

    upload = values["audio_max_upload_size"]
    limits = AudioLimits(AudioLimits().max_upload_bytes if upload is None else upload, values["audio_max_duration"])
    return AudioOptions(values["audio_queue_depth"], values["audio_request_timeout"], limits,
                        values["audio_beam_size"], values["threads"] or 0, runtime.device)


def _media_policy(values: dict[str, Any], environment: Environment) -> MediaPolicy:
    # The MLXCEL_* media variables come from the startup snapshot; a flag wins over its mirror.
    from mlxcel.media.limits import MediaPolicy

    return MediaPolicy.from_env(
        environment.raw, media_root=values["media_path"], max_image_payload_bytes=values["max_image_payload_size"],
        max_images=values["max_images"], video_max_frames=values["video_max_frames"], video_fps=values["video_fps"])


def _responses_db(values: dict[str, Any]) -> Path:
    path = values["responses_db"]
    return Path(path).expanduser() if path is not None else default_responses_db(values["models_dir"])


def _decode_step(values: dict[str, Any]) -> str:
    if not values["no_compile"]:
        return values["decode_step"]
    if values["decode_step"] not in ("auto", "eager"):
        raise ValueError(f"--no-compile contradicts --decode-step {values['decode_step']}: give one of them")
    return "eager"


def compile_cache_dir(models_dir: Path | None) -> Path:
    """Compiled decode steps persist beside the models (`<models dir>/compile-cache`)."""
    root = models_dir if models_dir is not None else Path.home() / ".cache" / "mlxcel"
    return Path(root).expanduser() / "compile-cache"


def _step_budget(batch_size: int, ubatch_size: int) -> int:
    if batch_size < 1 or ubatch_size < 1:
        raise ValueError(f"--batch-size and --ubatch-size must be at least 1 (got {batch_size}, {ubatch_size})")
    return min(batch_size, ubatch_size)


def configure_logging(verbose: bool, log_file: Path | None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None:
        handlers.append(logging.FileHandler(log_file, encoding="utf-8"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=LOG_FORMAT, handlers=handlers,
                        force=True)


def run_serve(settings: ServeSettings) -> int:
    """A6 in order: logging, API key, template + weights + engine + warmup, bind; then serve (A7)."""
    configure_logging(settings.verbose, settings.log_file)
    log.info("API key authentication: %s", f"on ({settings.api_key_source})" if settings.server.api_keys else "off")
    if settings.draft_model:
        log.error("--model-draft/--draft-model: speculative decoding is not available in this build")
        return 2
    from mlxcel.loading import ModelLoadError
    from mlxcel.server.lifecycle import Worker, bind_socket, serve
    from mlxcel.server.state import ServerState

    try:
        served, side = _start_models(settings)
    except (ModelLoadError, ValueError, OSError) as exc:
        log.error("cannot start: %s", exc)
        return 1
    # Side workers first: they stop taking requests before the chat engine goes (A7).
    workers = [Worker(f"{name} worker", stop) for name, stop in side.stoppers]
    workers += [Worker("chat engine", served.close)] if served is not None else []
    try:
        sock = bind_socket(settings.server)
    except OSError as exc:
        log.error("cannot listen: %s", exc)
        for worker in workers:
            worker.stop(10.0)
        return 1
    state = ServerState(settings.server, served, side=side, media=settings.media)
    if side.realtime is not None:
        state.realtime = _realtime_service(state, side)
    if settings.server.webui:  # A5: the served models change at run time; shutdown stops whatever is loaded
        workers = [Worker("models", _attach_control(state, settings))]
    return serve(state, sock, workers)


def _attach_control(state: ServerState, settings: ServeSettings) -> Callable[[float], bool]:
    from mlxcel.server.model_control import LoadSettings, ModelControl

    state.control = ModelControl(state, LoadSettings(settings.runtime, settings.engine, settings.models_dir,
                                                     settings.default_org, settings.side))
    key = settings.server.ui_session_key
    if key is not None:  # the terminal only: never into --log-file
        sys.stderr.write(f"mlxcel web UI session key (enter it at /webui/; valid until this server stops): {key}\n")
        sys.stderr.flush()
    return state.control.stop


def _realtime_service(state: ServerState, side: SideModels) -> RealtimeService:
    from mlxcel.api.realtime_cascade import CascadeEngine
    from mlxcel.server.realtime import RealtimeService

    assert side.realtime is not None and state.api is not None
    stt, tts = side.realtime
    assert stt.transcriber is not None and tts.synthesizer is not None
    return RealtimeService(CascadeEngine(stt.transcriber, state.api, tts.synthesizer), state.api.model_name)


def _start_models(settings: ServeSettings) -> tuple[ServedModel | None, SideModels]:
    """The chat model (unless single-purpose), then the embedding and rerank providers beside it (spec I)."""
    from mlxcel.loading import resolve_model
    from mlxcel.runtime import start_served_model
    from mlxcel.side_models import SideModelOptions, load_side_models, plan_process

    def resolve(arg: str | None) -> ResolvedModel:
        return resolve_model(arg, models_dir=settings.models_dir, default_org=settings.default_org)

    if settings.realtime_stt or settings.realtime_tts:
        return _start_realtime_process(settings, resolve)
    audio = _start_audio_process(settings, resolve)
    if audio is not None:
        return None, audio
    options = settings.side or SideModelOptions()
    if settings.server.webui and not settings.model:  # A5: model-less start; the UI loads one
        plan = _model_less_plan(options, resolve)
        log.info("web UI: starting without a chat model (chat routes answer 503 until one is loaded)")
    else:
        plan = plan_process(settings.model, options, resolve)
    served = None
    if plan.chat is not None:
        log.info("model: %s (%s)", plan.chat.name, plan.chat.source)
        served = start_served_model(plan.chat, settings.runtime, settings.engine)
    elif plan.mode is not None:
        log.info("%s process: no chat model is served (chat routes answer 501)", plan.mode.name)
    try:
        return served, load_side_models(plan, options, int(time.time()))
    except BaseException:
        if served is not None:
            served.close()
        raise


def _model_less_plan(options: SideModelOptions, resolve: Callable[[str | None], ResolvedModel]) -> ProcessPlan:
    """--webui without -m: no chat model (not even the default is looked for), side models as flagged."""
    from mlxcel.side_models import ProcessPlan, checkpoint_kind, resolve_side_model

    embedding = resolve_side_model(options.embedding_model, resolve) if options.embedding_model else None
    reranker = resolve_side_model(options.reranker_model, resolve) if options.reranker_model else None
    return ProcessPlan(None, embedding, reranker, checkpoint_kind(reranker.path) if reranker else None)


def _start_audio_process(settings: ServeSettings, resolve: Callable[[str | None], ResolvedModel]
                         ) -> SideModels | None:
    """An audio-only process when -m names a Whisper, Kokoro or Piper checkpoint (spec G)."""
    from mlxcel.audio_models import AudioOptions, audio_only_mode, find_audio_checkpoint, load_audio_models
    from mlxcel.side_models import SideModels

    found = find_audio_checkpoint(settings.model, resolve)
    if found is None:
        return None
    _refuse_side_flags(settings)
    audio = load_audio_models(found, settings.audio or AudioOptions(), int(time.time()))
    log.info("audio-only process: %s (chat routes answer 501)", audio_only_mode(audio.kind).serves)
    return SideModels(mode=audio_only_mode(audio.kind), audio=audio, stoppers=list(audio.stoppers))


def _start_realtime_process(settings: ServeSettings, resolve: Callable[[str | None], ResolvedModel]
                            ) -> tuple[ServedModel, SideModels]:
    """-m the chat model, --realtime-stt / --realtime-tts its ears and voice: /v1/realtime only (spec H)."""
    from mlxcel.api.modes import ModelEntry, SinglePurposeMode
    from mlxcel.audio_models import AudioOptions, find_audio_checkpoint, load_audio_models
    from mlxcel.runtime import start_served_model
    from mlxcel.side_models import SideModels
    from mlxcel.workers.audio_checkpoints import AudioKind

    if not (settings.realtime_stt and settings.realtime_tts):
        raise ValueError("--realtime-stt and --realtime-tts go together: the voice session needs both")
    _refuse_side_flags(settings)
    stt = find_audio_checkpoint(settings.realtime_stt, resolve)
    tts = find_audio_checkpoint(settings.realtime_tts, resolve)
    if stt is None or stt.checkpoint.kind is not AudioKind.WHISPER:
        raise ValueError(f"--realtime-stt {settings.realtime_stt}: not a Whisper checkpoint")
    if tts is None or tts.checkpoint.kind is AudioKind.WHISPER:
        raise ValueError(f"--realtime-tts {settings.realtime_tts}: not a Kokoro or Piper checkpoint")
    options, created = settings.audio or AudioOptions(), int(time.time())
    chat = resolve(settings.model)
    if find_audio_checkpoint(settings.model, resolve) is not None:
        raise ValueError(f"-m {settings.model}: the realtime cascade needs a chat model as -m")
    side = SideModels(mode=SinglePurposeMode(
        "realtime", "--realtime-stt", "Connect a WebSocket client to /v1/realtime; to serve the chat routes, start "
        "without --realtime-stt / --realtime-tts.", serves="a full-duplex voice session on the /v1/realtime "
        "WebSocket"))
    try:
        ears = load_audio_models(stt, options, created)
        side.stoppers.extend(ears.stoppers)
        voice = load_audio_models(tts, options, created)
        side.stoppers.extend(voice.stoppers)
        side.realtime = (ears, voice)
        side.realtime_entry = ModelEntry(chat.name, ("realtime",), created, 0)
        log.info("model: %s (%s), realtime cascade: %s -> chat -> %s", chat.name, chat.source, stt.name, tts.name)
        return start_served_model(chat, settings.runtime, settings.engine), side
    except BaseException:
        side.stop(10.0)
        raise


def _refuse_side_flags(settings: ServeSettings) -> None:
    side = settings.side
    if side is None:
        return
    flags = [flag for flag, is_set in (("--embedding-model", side.embedding_model), ("--reranker-model",
             side.reranker_model), ("--embeddings", side.is_embeddings_mode), ("--reranking",
             side.is_reranking_mode)) if is_set]
    if flags:
        raise ValueError(f"-m {settings.model} is an audio checkpoint, served in an audio-only process; "
                         f"drop {' and '.join(flags)} or give -m a chat model")


# ---- generate ----

async def _generate(served: ServedModel, values: dict[str, Any], out: TextIO, err: TextIO) -> None:
    from mlxcel.api.context import ApiContext
    from mlxcel.api.generation import Generation, GenerationParams
    from mlxcel.types import SamplingParams

    ctx = ApiContext(served.name, served.engine, served.tokenizer, served.chat_template, served.context_size,
                     int(time.time()))
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
    from mlxcel.runtime import RuntimeOptions, start_served_model

    try:
        resolved = resolve_model(values["model"], models_dir=values["models_dir"],
                                 default_org=environment["MLXCEL_DEFAULT_ORG"])
        runtime = RuntimeOptions(device=resolve_device(values["device"]), dtype=values["dtype"], warmup=False,
                                 chat_template=values["chat_template"], chat_template_file=values["chat_template_file"],
                                 threads=values["threads"], quantize=values["quantize"])
        served = start_served_model(resolved, runtime, EngineConfig(max_num_seqs=1, ctx_size=values["ctx_size"]))
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


# ---- entry points ----

def serve_parser(prog: str, style: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, formatter_class=HelpFormatter, allow_abbrev=False,
                                     description="Serve a model over the OpenAI, Anthropic and llama-server APIs.")
    add_options(parser, OPTIONS, style)
    return parser


def generate_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, formatter_class=HelpFormatter, allow_abbrev=False,
                                     description="Generate text once and exit; speed goes to stderr.")
    shared = [o for o in OPTIONS if o.dest in _GENERATE_SHARED]
    add_options(parser, GENERATE_OPTIONS + tuple(shared), "serve")
    return parser


def _serve_main(prog: str, style: str, argv: Sequence[str]) -> int:
    parser = serve_parser(prog, style)
    namespace = parser.parse_args(argv)
    try:
        environment = Environment.read()
        settings = serve_settings(resolve_values(namespace, OPTIONS, environment), environment)
    except ValueError as exc:  # EnvError, a bad config value, an unreadable key file
        parser.error(str(exc))
    return run_serve(settings)


def main(argv: Sequence[str] | None = None) -> int:
    """`mlxcel serve ...` or `mlxcel generate ...`."""
    args = list(sys.argv[1:] if argv is None else argv)
    commands = {"serve": "start the HTTP server", "generate": "generate text once from the command line",
                "cluster": "serve from N replicas on Ray Serve behind one endpoint (needs mlxcel[cluster])"}
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
    parser = generate_parser("mlxcel generate")
    namespace = parser.parse_args(args[1:])
    try:
        environment = Environment.read()
        values = resolve_values(namespace, GENERATE_OPTIONS + tuple(OPTIONS), environment)
    except ValueError as exc:
        parser.error(str(exc))
    return run_generate(values, environment)


def server_main(argv: Sequence[str] | None = None) -> int:
    """`mlxcel-server ...`: the same startup as `mlxcel serve`, llama-server spellings first."""
    return _serve_main("mlxcel-server", "server", list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
