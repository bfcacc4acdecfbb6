"""The command line and the environment, read through the settings table into what a command starts with.

Options come from the settings table (`mlxcel.settings.SETTINGS`): llama-server spellings with
aliases, a kind, a default and environment mirrors (`LLAMA_ARG_*`, `MLXCEL_*`, A10). argparse
only collects text; `resolve_values` parses every value through its setting, so a bad flag and
a bad variable get the same message. A flag on the command line wins over its mirror, which
wins over the default. `serve_settings` turns the values into the frozen configs of one serve
(`ServeSettings`: `RuntimeOptions`, `EngineConfig`, `ServerConfig`, `MediaPolicy`, ...). The
commands (`cli.py`), the startup path (`startup.py`) and the cluster (`cluster/`) read their
options here; this module imports none of them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxcel.config import EngineConfig, SpeculativeConfig
from mlxcel.env import Environment
from mlxcel.settings import GENERATE_SETTINGS, PERPLEXITY_SETTINGS, SETTINGS, Flag, Setting, plain
from mlxcel.server.config import ServerConfig, default_responses_db

if TYPE_CHECKING:  # torch-heavy modules load lazily, so --help stays fast
    from mlxcel.chat.plan import FeatureSettings
    from mlxcel.media.limits import MediaPolicy
    from mlxcel.serving.served_model import DiffusionOptions, RuntimeOptions
    from mlxcel.serving.side_models import ImageOptions, SideModelOptions
    from mlxcel.serving.audio_models import AudioOptions

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
OPTIONS: tuple[Setting, ...] = SETTINGS  # the serve table (its old name, for the cluster and tests)
GENERATE_OPTIONS: tuple[Setting, ...] = GENERATE_SETTINGS
_GENERATE_SHARED = ("model", "models_dir", "lora", "lora_init_without_apply", "chat_template", "chat_template_file",
                    "device", "dtype", "ctx_size", "verbose", "realtime_stt", "realtime_tts", "audio_beam_size",
                    "threads", "default_org", "quantize")
PERPLEXITY_OPTIONS: tuple[Setting, ...] = PERPLEXITY_SETTINGS
_PERPLEXITY_SHARED = ("model", "models_dir", "device", "dtype", "threads", "default_org", "quantize", "verbose",
                      "cache_type_k", "cache_type_v", "kv_cache_mode", "kv_quant_scheme", "batch_size", "ubatch_size",
                      "decode_step", "no_compile")
GROUP_TITLES = {"perplexity": "perplexity (llama-perplexity's flags)", "model": "model", "chat": "chat: reasoning, tools, templates", "engine": "engine",
                "sampling": "sampling defaults (unset: each protocol's own; a request's own field wins)",
                "server": "HTTP server", "logging": "logging",
                "generate": "generation", "side": "embeddings and rerank", "media": "media input",
                "image": "image generation (--image-model; without -m an image-only process)",
                "speculative": "speculative decoding",
                "diffusion": "block-diffusion text models (-m a DiffusionGemma checkpoint)",
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


def _names(flag: Flag, style: str) -> tuple[str, ...]:
    return flag.serve_names if style == "serve" and flag.serve_names else flag.names


def _help_text(setting: Setting, flag: Flag) -> str:
    extra = []
    if flag.action in ("value", "bool") and setting.default not in (None, "") and not setting.is_secret:
        extra.append(f"default: {plain(setting.default)}")
    if setting.env and flag is setting.flags[0]:
        extra.append(f"env: {', '.join(setting.env)}")
    if setting.is_mutable and flag is setting.flags[0]:
        extra.append("PATCH /v1/settings")
    text = flag.help or setting.help
    return f"{text} ({'; '.join(extra)})" if extra else text


def _metavar(setting: Setting, flag: Flag) -> str | None:
    if flag.action == "bool":
        return "BOOL"
    if flag.metavar:
        return flag.metavar
    return "{" + ",".join(setting.kind.enum) + "}" if setting.kind.enum else None


def add_options(parser: argparse.ArgumentParser, settings: Sequence[Setting], style: str) -> None:
    """One argument per flag; values stay text here, so every value is parsed (and refused) by its setting."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for setting in settings:
        group = groups.get(setting.group) or parser.add_argument_group(GROUP_TITLES[setting.group])
        groups[setting.group] = group
        for flag in setting.flags:
            kwargs: dict[str, Any] = {"dest": setting.name, "help": _help_text(setting, flag),
                                      "default": argparse.SUPPRESS}
            if flag.action in ("on", "off"):
                kwargs.update(action="store_const", const=flag.action == "on")
            elif flag.action == "append":
                kwargs.update(action="append", nargs=flag.nargs, metavar=flag.metavar)
            else:
                kwargs["metavar"] = _metavar(setting, flag)
                if flag.action == "bool":
                    kwargs.update(nargs="?", const="true")
            group.add_argument(*_names(flag, style), **kwargs)


def resolve_values(namespace: argparse.Namespace, settings: Sequence[Setting], environment: Environment
                   ) -> dict[str, Any]:
    """Command line, else the environment mirror, else the default (A10: CLI wins); SettingError if bad."""
    given = vars(namespace)
    values: dict[str, Any] = {}
    for setting in settings:
        if setting.name in given:
            value = given[setting.name]
            values[setting.name] = setting.parse(value) if isinstance(value, (str, list)) else value
        elif setting.name in environment.values:
            values[setting.name] = environment.values[setting.name]
        else:
            values[setting.name] = setting.default
    return values



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
    image: ImageOptions | None = None  # the image-generation provider (spec J); None = none
    values: Mapping[str, Any] = field(default_factory=dict)  # every setting's startup value (/v1/settings)


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
    from mlxcel.serving.served_model import RuntimeOptions

    keys, source = _api_keys(values)
    runtime = RuntimeOptions(device=resolve_device(values["device"]), dtype=values["dtype"],
                             chat_template=values["chat_template"], chat_template_file=values["chat_template_file"],
                             warmup=values["warmup"], chat=chat_settings(values, environment),
                             threads=values["threads"], quantize=values["quantize"],
                             adapters=lora_adapters(values),
                             weight_materialization=values["weight_materialization"],
                             diffusion=diffusion_options(values), engine_process=values["engine_process"],
                             mmproj=values["mmproj"])
    engine = EngineConfig(
        max_num_seqs=values["parallel"], ctx_size=values["ctx_size"],
        **_step_budget(values["batch_size"], values["ubatch_size"], runtime.device),
        max_queue_depth=values["max_queue_depth"], enable_prefix_caching=values["prompt_cache"],
        prefix_cache_dir=str(values["prefix_cache_dir"] or prefix_cache_dir(values["models_dir"])),
        prefix_cache_disk_bytes=_auto_bytes(values["prefix_cache_disk_size"]),
        prefix_cache_host_bytes=_auto_bytes(values["prefix_cache_host_size"]),
        max_kv_size=values["max_kv_size"], decode_timeout_s=values["decode_timeout"],
        kv_cache_bytes=values["kv_cache_memory"], request_memory_budget_bytes=values["request_memory_budget"] or 0,
        slot_save_path=values["slot_save_path"],
        cache_type_k=values["cache_type_k"], cache_type_v=values["cache_type_v"],
        kv_cache_mode=values["kv_cache_mode"], kv_quant_scheme=values["kv_quant_scheme"],
        decode_step=_decode_step(values), compile_cache_dir=str(compile_cache_dir(values["models_dir"])),
        n_predict=values["default_n_predict"], seed=values["default_seed"],
        speculative=speculative_settings(values))
    server = ServerConfig(
        host=values["host"], port=values["port"], api_keys=keys, alias=values["alias"], tags=_tags(values["tags"]),
        timeout_s=values["timeout"],
        max_body_bytes=values["max_body_size"], endpoint_slots=values["endpoint_slots"],
        endpoint_props=values["endpoint_props"], endpoint_metrics=values["endpoint_metrics"],
        sse_keepalive_s=values["sse_keepalive"], responses_db=_responses_db(values),
        stream_buffer_streams=values["stream_buffer_streams"], stream_buffer_bytes=values["stream_buffer_bytes"],
        stream_buffer_ttl_s=values["stream_buffer_ttl"],
        anthropic_pin_billing_stamp=values["anthropic_pin_billing_stamp"], **_browser_options(values, keys))
    return ServeSettings(values["model"], values["models_dir"], values["default_org"],
                         values["draft_model"], runtime, engine, server, values["verbose"], values["log_file"], source,
                         _side_options(values, runtime), _media_policy(values),
                         _audio_options(values, runtime), values["realtime_stt"], values["realtime_tts"],
                         values=MappingProxyType(dict(values)), image=_image_options(values, runtime))


def generate_settings(values: dict[str, Any]) -> tuple[RuntimeOptions, EngineConfig]:
    """What `generate` loads and runs with: serve's settings for the model, its adapters (F8) and the decode
    step (MLXCEL_DECODE_STEP / MLXCEL_NO_COMPILE), one slot, no warmup."""
    from mlxcel.serving.served_model import RuntimeOptions

    runtime = RuntimeOptions(device=resolve_device(values["device"]), dtype=values["dtype"], warmup=False,
                             chat_template=values["chat_template"], chat_template_file=values["chat_template_file"],
                             threads=values["threads"], quantize=values["quantize"], adapters=lora_adapters(values),
                             weight_materialization=values["weight_materialization"])
    engine = EngineConfig(max_num_seqs=1, ctx_size=values["ctx_size"], decode_step=_decode_step(values),
                          compile_cache_dir=str(compile_cache_dir(values["models_dir"])))
    return runtime, engine


def perplexity_settings(values: dict[str, Any], n_ctx: int) -> tuple[RuntimeOptions, EngineConfig]:
    """What `perplexity` loads and runs with: serve's model, weights rewrite, KV types and step budget, one
    slot of `n_ctx` tokens and no prefix cache (each chunk stands alone), no warmup."""
    from mlxcel.serving.served_model import RuntimeOptions

    runtime = RuntimeOptions(device=resolve_device(values["device"]), dtype=values["dtype"], warmup=False,
                             threads=values["threads"], quantize=values["quantize"],
                             weight_materialization=values["weight_materialization"])
    engine = EngineConfig(max_num_seqs=1, ctx_size=n_ctx + 1, enable_prefix_caching=False,
                          **_step_budget(values["batch_size"], values["ubatch_size"], runtime.device),
                          cache_type_k=values["cache_type_k"], cache_type_v=values["cache_type_v"],
                          kv_cache_mode=values["kv_cache_mode"], kv_quant_scheme=values["kv_quant_scheme"],
                          decode_step=_decode_step(values),
                          compile_cache_dir=str(compile_cache_dir(values["models_dir"])))
    return runtime, engine


def diffusion_options(values: dict[str, Any]) -> DiffusionOptions:
    """Spec U's flags; a ValueError names the flag (the confidence sampler's threshold is a probability)."""
    from mlxcel.serving.served_model import DiffusionOptions

    return DiffusionOptions(values["diffusion_sampler"], values["diffusion_threshold"], values["max_denoising_steps"],
                            values["diffusion_request_timeout"])


def _auto_bytes(value: str | int) -> int:
    """A size setting that may be `auto` (-1: the engine picks by device)."""
    return -1 if value == "auto" else int(value)


def lora_adapters(values: dict[str, Any]) -> tuple[tuple[Path, float], ...]:
    """--lora / --adapter / --lora-scaled in the order given: (path, scale); ids follow this order (F8)."""
    adapters = values.get("lora") or ()
    return tuple((path, 0.0) for path, _ in adapters) if values.get("lora_init_without_apply") else adapters


def speculative_settings(values: dict[str, Any]) -> SpeculativeConfig:
    """--draft-kind and its bounds (B1-B4); --draft-model alone means full-model drafting (llama-server's -md),
    with --draft-kind dflash it is the DFlash drafter's checkpoint directory."""
    kind, draft_model = values["draft_kind"], values["draft_model"]
    if draft_model and kind == "none":
        kind = "full-model"
    if draft_model and kind not in ("full-model", "dflash"):
        raise ValueError(f"--draft-model is for --draft-kind full-model or dflash, not {kind}")
    return SpeculativeConfig(draft_kind=kind, draft_max=values["draft_max"], draft_min=values["draft_min"],
                             max_batch=values["prompt_lookup_max_batch"], ngram_size=values["prompt_lookup_ngram"],
                             draft_model=draft_model, block_size=values["draft_block_size"], mtp=values["mtp"])


def draft_refusal(spec: SpeculativeConfig) -> str | None:
    """Why a speculative setting cannot start (B1, B3), or None."""
    if spec.draft_kind == "dflash" and not spec.draft_model:
        return ("--draft-kind dflash needs --draft-model DIR: a DFlash block-diffusion drafter checkpoint trained "
                "for this model (config.json with dflash_config, and .safetensors weights)")
    if spec.draft_kind == "full-model" and not spec.draft_model:
        return "--draft-kind full-model needs --draft-model PATH (a small model with the target's tokenizer)"
    return None


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
    from mlxcel.chat.plan import FeatureSettings

    settings = FeatureSettings(
        reasoning_format=values["reasoning_format"], reasoning_budget=values["reasoning_budget"],
        chat_template_kwargs=values["chat_template_kwargs"],
        chat_template_kwargs_env=values["chat_template_kwargs_env"], loop_detection=values["loop_detection"],
        echo_max_bytes=values["reasoning_echo_max_bytes"], skip_chat_parsing=values["skip_chat_parsing"])
    return settings.checked()


def _side_options(values: dict[str, Any], runtime: RuntimeOptions) -> SideModelOptions:
    from mlxcel.serving.side_models import side_model_options

    return side_model_options(
        embedding_model=values["embedding_model"], reranker_model=values["reranker_model"],
        pooling=values["pooling"], embd_normalize=values["embd_normalize"],
        embedding_batch_size=values["embedding_batch_size"], rerank_batch_size_flag=values["rerank_batch_size"],
        queue_depth=values["embedding_queue_depth"], request_timeout_s=values["embedding_request_timeout"],
        is_embeddings_mode=values["embeddings_mode"], is_reranking_mode=values["reranking_mode"],
        device=runtime.device, dtype=str(runtime.torch_dtype()).removeprefix("torch."))


def _image_options(values: dict[str, Any], runtime: RuntimeOptions) -> ImageOptions | None:
    from mlxcel.serving.side_models import image_options

    if not values["image_model"]:
        return None
    return image_options(values["image_model"], values["image_queue_depth"], values["image_request_timeout"],
                         device=runtime.device, dtype=str(runtime.torch_dtype()).removeprefix("torch."))


def _audio_options(values: dict[str, Any], runtime: RuntimeOptions) -> AudioOptions:
    from mlxcel.api.audio import AudioLimits
    from mlxcel.serving.audio_models import AudioOptions

    upload = values["audio_max_upload_size"]
    limits = AudioLimits(AudioLimits().max_upload_bytes if upload is None else upload, values["audio_max_duration"])
    return AudioOptions(values["audio_queue_depth"], values["audio_request_timeout"], limits,
                        values["audio_beam_size"], values["threads"] or 0, runtime.device)


def _media_policy(values: Mapping[str, Any]) -> MediaPolicy:
    # Flags and their MLXCEL_* mirrors were resolved by the settings table; unset ones keep the policy's defaults.
    from mlxcel.media.limits import MediaPolicy, parse_dir_allowlist

    allowlist = values["video_dir_allowlist"]
    return MediaPolicy.from_values(
        media_root=values["media_path"], max_image_payload_bytes=values["max_image_payload_size"],
        max_images=values["max_images"], video_max_frames=values["video_max_frames"], video_fps=values["video_fps"],
        allow_private_urls=values["allow_private_media_urls"],
        video_dir_allowlist=parse_dir_allowlist("MLXCEL_VIDEO_DIR_ALLOWLIST", allowlist) if allowlist else None)


def _tags(value: str | None) -> tuple[str, ...]:
    """--tags as llama-server reads it: comma-separated, stripped, sorted, no duplicates."""
    return tuple(sorted({tag.strip() for tag in (value or "").split(",") if tag.strip()}))


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


def prefix_cache_dir(models_dir: Path | None) -> Path:
    """The prefix cache's disk tier lives beside the models (`<models dir>/prefix-cache`, issue 29)."""
    return compile_cache_dir(models_dir).with_name("prefix-cache")


def _step_budget(batch_size: int, ubatch_size: int, device: str) -> dict[str, int]:
    """EngineConfig's step budget: tokens in all (decode rows too) and prompt tokens (at most as many).
    --ubatch-size 0: 512 on the CPU (a prefill chunk's compute delays the step's decode rows) and 2048 on a
    GPU (an eager prefill step is bound by its kernel launches: on an H200 the server's tokens a second at
    256 streams went from 5,815 to 8,585 greedy and from 5,762 to 10,388 sampled, bench/RESULTS.md)."""
    if batch_size < 1 or ubatch_size < 0:
        raise ValueError(f"--batch-size must be at least 1 and --ubatch-size at least 0 (got {batch_size}, {ubatch_size})")
    prompt_tokens = ubatch_size or (512 if device == "cpu" else 2048)
    return {"max_num_batched_tokens": batch_size, "max_num_prefill_tokens": min(batch_size, prompt_tokens)}


def configure_logging(verbose: bool, log_file: Path | None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None:
        handlers.append(logging.FileHandler(log_file, encoding="utf-8"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=LOG_FORMAT, handlers=handlers,
                        force=True)


# ---- parsers ----

def serve_parser(prog: str, style: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, formatter_class=_EpilogFormatter, allow_abbrev=False,
                                     description="Serve a model over the OpenAI, Anthropic and llama-server APIs.",
                                     epilog=environment_help(OPTIONS))
    add_options(parser, OPTIONS, style)
    return parser


class _EpilogFormatter(HelpFormatter):
    """Keeps the epilog's one-setting-per-line layout."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(indent + line for line in text.splitlines())


def environment_help(settings: Sequence[Setting]) -> str:
    """The settings with no flag, by variable (the rest show `env:` beside their flag)."""
    lines = [f"  {s.env[0]:<36} {s.help}" + (f" (default: {plain(s.default)})" if s.default not in (None, "") else "")
             for s in settings if s.env and not s.flags]
    return "environment only:\n" + "\n".join(lines) + "\n\nPATCH /v1/settings changes: " + ", ".join(
        s.name for s in settings if s.is_mutable)


def perplexity_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, formatter_class=HelpFormatter, allow_abbrev=False,
                                     description="Perplexity of a text, and KL divergence against a base's logits, "
                                                 "as llama-perplexity computes them; results on stdout, progress "
                                                 "on stderr.")
    shared = [s for s in OPTIONS if s.name in _PERPLEXITY_SHARED]
    add_options(parser, PERPLEXITY_OPTIONS + tuple(shared), "serve")
    return parser


def generate_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, formatter_class=HelpFormatter, allow_abbrev=False,
                                     description="Generate text once and exit; speed goes to stderr.")
    shared = [s for s in OPTIONS if s.name in _GENERATE_SHARED]
    add_options(parser, GENERATE_OPTIONS + tuple(shared), "serve")
    return parser
