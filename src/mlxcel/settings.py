"""Every setting of the process, declared once (issue 13, F9, A10).

A `Setting` is one record: its name (the key of `/v1/settings` and of the resolved values), its
`Kind` (how text becomes a value and what values are accepted), its default, its command-line
spellings (`Flag`s: llama-server's spellings with aliases), its environment mirrors
(`LLAMA_ARG_*` / `MLXCEL_*`), whether it may change at run time, and its help text. The CLI
parser, the environment reader (`env.py`), the media policy, `--help`, the README's settings
table and `/v1/settings` are all built from `SETTINGS`, and every bad value, whether it came
from a flag, a variable or a PATCH body, gets the same `SettingError` message naming the
setting and the values it accepts. Adding a setting is adding one record here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel.config import CACHE_TYPES, DECODE_STEPS, DRAFT_KINDS, KV_CACHE_MODES, KV_QUANT_SCHEMES, MTP_MODES

_TRUE = frozenset({"1", "true", "yes", "on", "enabled"})
_FALSE = frozenset({"0", "false", "no", "off", "disabled", ""})
_SIZE_UNITS = {"": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
               "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}
MAX_SIZE = (1 << 63) - 1  # a larger byte count is an overflow, not a budget


class SettingError(ValueError):
    """A value a setting cannot take; the message names the setting and what it accepts."""

    def __init__(self, setting: Setting, text: str, reason: str = "") -> None:
        detail = f" ({reason})" if reason and reason != setting.kind.accepted else ""
        super().__init__(f"{setting.label}: {text!r} is not valid{detail}; expected {setting.kind.accepted}")
        self.setting = setting


# ---- kinds: how text becomes a value ----

@dataclass(frozen=True, slots=True)
class Kind:
    """A value type: its JSON schema type, a phrase for the accepted values, the parser (raises ValueError)."""

    json_type: str  # string | integer | number | boolean | object
    accepted: str
    parse: Callable[[str], Any]
    enum: tuple[str, ...] | None = None


def parse_bool(text: str) -> bool:
    """llama.cpp's spellings: 1/true/yes/on/enabled and 0/false/no/off/disabled (empty is false)."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected true or false, not {text!r}")


def parse_size(text: str) -> int:
    """A byte count: 33554432, 32M, 32MiB, 1G (binary units)."""
    value = text.strip().lower()
    digits = value.rstrip("kmgtib")
    unit = value[len(digits):]
    if not digits.isdigit() or unit not in _SIZE_UNITS:
        raise ValueError(f"expected a size such as 32M or 33554432, not {text!r}")  # parse_size's own callers
    size = int(digits) * _SIZE_UNITS[unit]
    if size > MAX_SIZE:
        raise ValueError(f"{text!r} overflows a 64-bit byte count")
    return size


def _number(kind: Callable[[str], Any], text: str) -> Any:
    """`kind(text)` with its own message dropped: the setting's accepted values replace it."""
    try:
        return kind(text.strip())
    except ValueError:
        raise ValueError("") from None  # the accepted values say it all


def integer(minimum: int | None = None) -> Kind:
    """A whole number, optionally at least `minimum`."""
    accepted = "a whole number" + (f" >= {minimum}" if minimum is not None else "")

    def parse(text: str) -> int:
        value = _number(int, text)
        if minimum is not None and value < minimum:
            raise ValueError("")
        return value

    return Kind("integer", accepted, parse)


def number(*, is_positive: bool = False, minimum: float | None = None, maximum: float | None = None) -> Kind:
    """A finite number (above 0 when `is_positive`, within `minimum`..`maximum` when given)."""
    bounds = [bound for bound in ("above 0" if is_positive else "", f">= {minimum:g}" if minimum is not None else "",
                                  f"<= {maximum:g}" if maximum is not None else "") if bound]
    accepted = " ".join(["a finite number", " and ".join(bounds)]).strip()

    def parse(text: str) -> float:
        value = _number(float, text)
        is_out = (is_positive and value <= 0) or (minimum is not None and value < minimum) or (
            maximum is not None and value > maximum)
        if not math.isfinite(value) or is_out:
            raise ValueError("")
        return value

    return Kind("number", accepted, parse)


def size(*, is_positive: bool = False) -> Kind:
    accepted = "a byte size such as 512M, 24G or 33554432" + (" (above 0)" if is_positive else "")

    def parse(text: str) -> int:
        try:
            value = parse_size(text)
        except ValueError as exc:
            raise ValueError("overflow" if "overflow" in str(exc) else "") from None
        if is_positive and value <= 0:
            raise ValueError("")
        return value

    return Kind("integer", accepted, parse)


def auto_size() -> Kind:
    """`auto` or a byte size (the host KV tier's bound)."""
    sized = size()

    def parse(text: str) -> str | int:
        return "auto" if text.strip().lower() == "auto" else sized.parse(text)

    return Kind("string", "auto or a byte size such as 512M, 24G or 33554432 (0 = off)", parse)


def choice(*values: str) -> Kind:
    def parse(text: str) -> str:
        if text not in values:
            raise ValueError("")
        return text

    return Kind("string", f"one of {', '.join(values)}", parse, enum=values)


def _parse_adapters(value: str | list[Any]) -> tuple[tuple[Path, float], ...]:
    """LoRA adapters (F8) in the order given: `PATH` (scale 1) or `PATH:SCALE`, comma-separated in the
    environment; on the command line the uses of --lora (a path) and --lora-scaled (path, scale)."""
    items = [part for part in value.split(",") if part.strip()] if isinstance(value, str) else value
    adapters = []
    for item in items:
        if isinstance(item, str):
            path, _, scale = item.rpartition(":")
            if not path or not _is_number(scale):
                path, scale = item, "1"
        else:
            path, scale = item
        adapters.append((Path(path.strip()).expanduser(), _number(float, scale)))
    return tuple(adapters)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


ADAPTERS = Kind("array", "adapter folders: PATH or PATH:SCALE, comma-separated", _parse_adapters)


def _json_object(text: str) -> str:
    if not isinstance(json.loads(text), dict):
        raise ValueError("not a JSON object")
    return text


def _loop_detection(text: str) -> str | None:
    from mlxcel.chat.loop_guard import parse_operator_override

    _number(parse_operator_override, text)  # its message is this kind's accepted values
    return text or None


def _dir_allowlist(text: str) -> str:
    from mlxcel.media.limits import parse_dir_allowlist

    parse_dir_allowlist("MLXCEL_VIDEO_DIR_ALLOWLIST", text)
    return text


TEXT = Kind("string", "text", str)
PATH = Kind("string", "a file or folder path", lambda text: Path(text).expanduser())
BOOL = Kind("boolean", "true or false (1/0, yes/no, on/off, enabled/disabled)",
            lambda text: _number(parse_bool, text))  # the accepted values say it all
INT = integer()
COUNT = integer(minimum=1)
NON_NEGATIVE = integer(minimum=0)
SECONDS = number(is_positive=True)
SIZE = size()
JSON_OBJECT = Kind("string", "a JSON object such as {\"enable_thinking\": false}", _json_object)
LOOP_DETECTION = Kind("string", "off, on, or key=value pairs with keys max_pattern_size, min_pattern_size, "
                      "min_count", _loop_detection)
DIR_ALLOWLIST = Kind("string", "absolute, existing folders separated by ':' or ','", _dir_allowlist)


# ---- the records ----

@dataclass(frozen=True, slots=True)
class Flag:
    """One command-line switch of a setting. action: value | on (sets True) | off (sets False) | bool (--x[=BOOL])
    | append."""

    names: tuple[str, ...]
    action: str = "value"  # or append: repeatable, each use adds `nargs` values (one when None)
    help: str | None = None  # default: the setting's
    serve_names: tuple[str, ...] | None = None  # `mlxcel serve`'s order, when it differs from mlxcel-server's
    metavar: str | tuple[str, ...] | None = None
    nargs: int | None = None


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting, declared once."""

    name: str
    kind: Kind
    default: Any
    help: str
    flags: tuple[Flag, ...] = ()
    env: tuple[str, ...] = ()
    is_mutable: bool = False  # PATCH /v1/settings may change it; it takes effect on the next request
    is_secret: bool = False  # never shown as a value
    group: str = "server"

    @property
    def label(self) -> str:
        """`name (--flag, ENV)`: how every message names the setting."""
        valued = [flag for flag in self.flags if flag.action in ("value", "bool")] or list(self.flags)
        spellings = [flag.names[0] for flag in valued[:1]] + list(self.env[:1])
        return f"{self.name} ({', '.join(spellings)})" if spellings else self.name

    def parse(self, text: str) -> Any:
        """The value for `text`; a SettingError with the one message for this setting."""
        try:
            return self.kind.parse(text)
        except (ValueError, TypeError) as exc:
            raise SettingError(self, text, str(exc)) from None

    def parse_json(self, value: Any) -> Any:
        """A PATCH value: JSON of the setting's type (or text) goes through the same parser."""
        if value is None and self.default is None:
            return None
        return self.parse(json_text(value))

    def schema(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": self.kind.json_type, "accepted": self.kind.accepted,
                                 "default": None if self.is_secret else plain(self.default),
                                 "nullable": self.default is None, "mutable": self.is_mutable,
                                 "flags": [name for flag in self.flags for name in flag.names],
                                 "env": list(self.env), "description": self.help}
        if self.kind.enum:
            entry["enum"] = list(self.kind.enum)
        return entry


def json_text(value: Any) -> str:
    """The text a flag would carry for a JSON value (true -> "true", 3 -> "3")."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def plain(value: Any) -> Any:
    """A value as JSON shows it (paths as text)."""
    return str(value) if isinstance(value, Path) else value


def _s(name: str, kind: Kind, default: Any, help: str, flags: Iterable[str] | Iterable[Flag] = (),  # noqa: A002
       env: str | tuple[str, ...] = (), *, group: str = "server", action: str = "value",
       serve_names: tuple[str, ...] | None = None, metavar: str | None = None, is_mutable: bool = False,
       is_secret: bool = False) -> Setting:
    """One record in one call: plain flag names become one Flag with `action`."""
    names = tuple(flags)
    flag_records = names if names and isinstance(names[0], Flag) else (
        (Flag(names, action, serve_names=serve_names, metavar=metavar),) if names else ())
    return Setting(name, kind, default, help, flag_records, (env,) if isinstance(env, str) else env,  # type: ignore[arg-type]
                   is_mutable, is_secret, group)


SETTINGS: tuple[Setting, ...] = (
    # model
    _s("model", TEXT, None, "GGUF file, Hugging Face folder, owner/name repo id or bare name (read as "
       "$MLXCEL_DEFAULT_ORG/NAME); default: the embedded SmolLM2-135M-Instruct; a Florence-2 folder serves vision "
       "tasks on /v1/chat/completions from a single-stream worker", ("-m", "--model"),
       "LLAMA_ARG_MODEL", metavar="MODEL", group="model"),
    _s("alias", TEXT, None, "model names, comma-separated: the first in sorted order is the id reported by "
       "/v1/models and responses, all are listed as its aliases", ("-a", "--alias"), "LLAMA_ARG_ALIAS",
       metavar="NAME", group="model"),
    _s("tags", TEXT, None, "model tags, comma-separated (informational: listed by /v1/models)", ("--tags",),
       "LLAMA_ARG_TAGS", metavar="TAGS", group="model"),
    _s("models_dir", PATH, None, "where downloaded models are stored", ("--models-dir",), "MLXCEL_MODELS_DIR",
       metavar="PATH", group="model"),
    _s("default_org", TEXT, "mlx-community", "owner used for bare model names (A2)", (), "MLXCEL_DEFAULT_ORG",
       group="model"),
    _s("weight_materialization", choice("eager", "lazy"), "eager", "how weights are loaded (A6): eager (fully, "
       "before \"Model loaded\") or lazy (the checkpoint mapped, each tensor read on first use)", (),
       "MLXCEL_WEIGHT_MATERIALIZATION", group="model"),
    _s("lora", ADAPTERS, None, "PEFT LoRA adapter folders (adapter_config.json + adapter_model.safetensors), "
       "applied beside the weights, not merged (F8); --lora PATH at scale 1, --lora-scaled PATH SCALE; "
       "repeatable, ids in the order given", (Flag(("--lora", "--adapter"), "append", metavar="PATH"),
                                             Flag(("--lora-scaled",), "append", metavar=("PATH", "SCALE"), nargs=2,
                                                  help="load a LoRA adapter at this scale; repeatable")),
       ("LLAMA_ARG_LORA", "LLAMA_ARG_LORA_SCALED"), group="model"),
    _s("lora_init_without_apply", BOOL, False, "load the adapters at scale 0 (set scales later with POST "
       "/lora-adapters or a request's lora field)", ("--lora-init-without-apply",),
       "LLAMA_ARG_LORA_INIT_WITHOUT_APPLY", group="model", action="on"),
    _s("draft_model", TEXT, None, "draft model for speculative decoding (B1): a small model with -m's tokenizer; implies --draft-kind "
       "full-model; with --draft-kind dflash, the DFlash drafter's checkpoint directory (B3)",
       ("--model-draft", "-md", "--draft-model"), "LLAMA_ARG_MODEL_DRAFT", metavar="MODEL", group="model",
       serve_names=("--draft-model", "-md", "--model-draft")),
    _s("chat_template", TEXT, None, "chat template: Jinja source or a built-in name (default: the model's own)",
       ("--chat-template",), "LLAMA_ARG_CHAT_TEMPLATE", metavar="TEMPLATE", group="model"),
    _s("chat_template_file", PATH, None, "read the chat template from a file", ("--chat-template-file",),
       "LLAMA_ARG_CHAT_TEMPLATE_FILE", metavar="PATH", group="model"),
    _s("mmproj", PATH, None, "llama.cpp's multimodal projector GGUF beside a GGUF -m (its vision tower and "
       "projector; gemma3, idefics3, LLaVA 1.5's mlp); the model then takes images", ("--mmproj", "-mm"), "LLAMA_ARG_MMPROJ", metavar="FILE",
       group="model"),
    _s("device", TEXT, "auto", "torch device: auto, cpu, cuda, cuda:N", ("--device", "-dev"), "LLAMA_ARG_DEVICE",
       metavar="DEVICE", group="model"),
    _s("dtype", choice("auto", "float32", "bfloat16", "float16"), "auto", "weight and KV dtype (auto = float32 on "
       "CPU, bfloat16 on CUDA)", ("--dtype",), "LLAMA_ARG_DTYPE", group="model"),
    _s("warmup", BOOL, True, "skip the warmup before listening (decode-step compile or capture, a short prompt and "
       "8 tokens)", ("--no-warmup",), group="model", action="off"),
    _s("engine_process", choice("auto", "on", "off"), "auto", "run the engine core (model, scheduler, KV cache, "
       "sampler) in its own process, apart from HTTP, templates and detokenization (issue 25): auto = on with "
       "a GPU, off on the CPU (measured: see bench/RESULTS.md)", ("--engine-process",), "MLXCEL_ENGINE_PROCESS", group="model"),
    _s("threads", NON_NEGATIVE, 0, "CPU threads for the model (0 = torch's default: every core)",
       ("-t", "--threads"), "LLAMA_ARG_THREADS", metavar="N", group="model"),
    _s("quantize", choice("auto", "off"), "auto", "CPU decode matmuls: auto = weight-only 4-bit (where the "
       "checkpoint is 4-bit) or int8; on CUDA, auto keeps a quantized folder's 4-bit and FP8 weights as stored; "
       "off = plain --dtype", ("--quantize",), "MLXCEL_QUANTIZE", group="model"),
    # chat behaviour (S, R, Q, P)
    _s("reasoning_format", choice("none", "deepseek", "deepseek-legacy", "auto"), "auto", "where reasoning goes: "
       "none (in the content), deepseek / auto (reasoning_content), deepseek-legacy (both)",
       ("--reasoning-format",), "LLAMA_ARG_THINK", group="chat"),
    _s("reasoning_budget", integer(minimum=-1), -1, "reasoning tokens before </think> is forced: -1 unlimited, "
       "0 none (requests may override)", ("--reasoning-budget",), "LLAMA_ARG_REASONING_BUDGET", metavar="N",
       group="chat", is_mutable=True),
    _s("chat_template_kwargs", JSON_OBJECT, None, "default chat-template kwargs, a JSON object; merged per key "
       "over chat_template_kwargs_env", ("--chat-template-kwargs",), metavar="JSON", group="chat"),
    _s("chat_template_kwargs_env", JSON_OBJECT, None, "default chat-template kwargs from the environment, under "
       "--chat-template-kwargs", (), "LLAMA_ARG_CHAT_TEMPLATE_KWARGS", group="chat"),
    _s("skip_chat_parsing", BOOL, False, "return generated text as is: no reasoning or tool-call parsing",
       ("--skip-chat-parsing",), "LLAMA_ARG_SKIP_CHAT_PARSING", group="chat", action="on"),
    _s("loop_detection", LOOP_DETECTION, None, "operator override of the n-gram repeat guard (P): off, on or "
       "max_pattern_size=N,min_pattern_size=N,min_count=N", (), "MLXCEL_LOOP_DETECTION", group="chat",
       is_mutable=True),
    _s("reasoning_echo_max_bytes", NON_NEGATIVE, 16 << 20, "reasoning echo store size in bytes; 0 disables (Q)",
       (), "MLXCEL_REASONING_ECHO_MAX_BYTES", group="chat"),
    # engine
    _s("parallel", COUNT, 4, "request slots served at once", ("--parallel", "-np", "--n-parallel"),
       "LLAMA_ARG_N_PARALLEL", metavar="N", group="engine", serve_names=("--n-parallel", "-np", "--parallel")),
    _s("ctx_size", NON_NEGATIVE, 0, "total context tokens over all slots (0 = the model's, per slot)",
       ("-c", "--ctx-size"), "LLAMA_ARG_CTX_SIZE", metavar="N", group="engine"),
    _s("batch_size", COUNT, 2048, "most tokens one engine step may compute", ("-b", "--batch-size"),
       "LLAMA_ARG_BATCH", metavar="N", group="engine"),
    _s("ubatch_size", NON_NEGATIVE, 0, "prefill chunk: most prompt tokens per step (0 = 512 on the CPU, 2048 on a "
       "GPU, where eager prefill steps are bound by their launches)", ("-ub", "--ubatch-size"),
       "LLAMA_ARG_UBATCH", metavar="N", group="engine"),
    _s("max_queue_depth", NON_NEGATIVE, 64, "waiting requests before 503 + Retry-After (a Florence-2 worker's too)",
       ("--max-queue-depth",),
       "LLAMA_ARG_MAX_QUEUE_DEPTH", metavar="N", group="engine", is_mutable=True),
    _s("prompt_cache", BOOL, True, "automatic prefix caching (APC) on or off", (
        Flag(("--no-prompt-cache", "--no-cache-prompt"), "off", "turn prefix caching (APC) off"),
        Flag(("--apc-enabled",), "bool", "automatic prefix caching on or off (--apc-enabled=false)")),
       "LLAMA_ARG_APC_ENABLED", group="engine"),
    _s("prefix_cache_dir", PATH, None, "folder of the prefix cache's disk tier: KV blocks that survive restarts "
       "(default: <models dir>/prefix-cache; without --models-dir ~/.cache/mlxcel/prefix-cache; GET /props shows it)",
       ("--prefix-cache-dir",), "MLXCEL_PREFIX_CACHE_DIR", metavar="DIR", group="engine"),
    # on by default (issue 29): a restart finds the long prompts it had already computed
    # NOTE: auto is off on CUDA: on an H200 loading a prompt's blocks from disk took longer than recomputing them
    # (bench/prefix_host_tier.py), and saving evicted blocks stalled the engine thread under many streams
    _s("prefix_cache_disk_size", auto_size(), "auto", "most bytes the prefix cache's disk tier keeps in its folder, "
       "least recently used dropped first (auto = 20G on the CPU, 0 on CUDA, where recomputing was faster than "
       "loading; 0 = no disk tier; POST /v1/cache/reset deletes the served model's files)",
       ("--prefix-cache-disk-size",),
       "MLXCEL_PREFIX_CACHE_DISK_SIZE", metavar="SIZE", group="engine"),
    # issue 29 point 5: on a GPU, device evictions park in pinned host RAM before the disk tier
    # NOTE: off by default: its saves still run on the engine thread (half of the engine process's time under
    # 256 fresh streams on an H200), so it is for workloads that come back to long prefixes
    _s("prefix_cache_host_size", auto_size(), 0, "most bytes of KV blocks the prefix cache keeps in host memory "
       "between the GPU's KV pool and the disk tier, least recently used spilled to disk (0 = off; auto = a quarter "
       "of RAM on CUDA, 0 on the CPU, where the KV pool already is host memory)", ("--prefix-cache-host-size",),
       "MLXCEL_PREFIX_CACHE_HOST_SIZE", metavar="SIZE", group="engine"),
    _s("max_kv_size", NON_NEGATIVE, 0, "keep only the newest N tokens live (0 = off, else 64..2^31-1)",
       ("--max-kv-size",), "LLAMA_ARG_MAX_KV_SIZE", metavar="N", group="engine"),
    _s("kv_cache_memory", SIZE, 0, "cap the KV pool at this many bytes (e.g. 512M; 0 = room for every slot's full "
       "context; a hybrid model's recurrent-state pool counts in it); a smaller pool preempts and recomputes under "
       "pressure", ("--kv-cache-memory",),
       "MLXCEL_KV_CACHE_MEMORY", metavar="SIZE", group="engine"),
    _s("request_memory_budget", size(is_positive=True), None, "lower the request memory budget (O): a request "
       "whose KV blocks (prompt + max output) exceed it gets 503 request_memory_budget_exceeded; default and "
       "ceiling: what the KV pool holds; "
       "less than one KV block refuses startup (exit 2)", (), "MLXCEL_REQUEST_MEMORY_BUDGET", group="engine"),
    _s("cache_type_k", choice(*CACHE_TYPES), "bf16", "KV cache element type for keys: f32, bf16, f16 or q8_0 "
       "(int8 codes, a float16 scale per 32)", ("-ctk", "--cache-type-k"), "LLAMA_ARG_CACHE_TYPE_K", group="engine",
       serve_names=("--cache-type-k", "-ctk")),
    _s("cache_type_v", choice(*CACHE_TYPES), "bf16", "KV cache element type for values: f32, bf16, f16 or q8_0",
       ("-ctv", "--cache-type-v"), "LLAMA_ARG_CACHE_TYPE_V", group="engine", serve_names=("--cache-type-v", "-ctv")),
    _s("kv_cache_mode", choice(*KV_CACHE_MODES), "default", "KV cache quantization (N2): turbo4 stores keys and "
       "values in 4 bits after a fixed random orthogonal turn (overrides --cache-type-k/-v; --max-kv-size is "
       "then ignored, with a warning)", ("--kv-cache-mode",), "MLXCEL_KV_CACHE_MODE", group="engine"),
    _s("kv_quant_scheme", choice(*KV_QUANT_SCHEMES), "none", "KV quantization scheme (N2): turboquant = the "
       "turbo4 store of --kv-cache-mode", ("--kv-quant-scheme",), "MLXCEL_KV_QUANT_SCHEME", group="engine"),
    _s("decode_step", choice(*DECODE_STEPS), "auto", "how decode steps run: auto = native on CPU (Llama/Qwen2 "
       "decoder layers in one C++ call; other models compile) and CUDA graphs on CUDA; native, compile "
       "(torch.compile), cuda-graph or eager", ("--decode-step",), "MLXCEL_DECODE_STEP", group="engine"),
    _s("no_compile", BOOL, False, "run decode steps eagerly, op by op (as --decode-step eager): no compile time "
       "at startup", ("--no-compile",), "MLXCEL_NO_COMPILE", group="engine", action="on"),
    _s("default_n_predict", integer(minimum=-1), -1, "most tokens a request that sets no limit generates (its "
       "own max_tokens / n_predict wins, as llama-server's; -1 = until its context is full)",
       ("-n", "--n-predict", "--predict"), "LLAMA_ARG_N_PREDICT", metavar="N", group="engine", is_mutable=True),
    _s("default_seed", integer(minimum=-1), -1, "sampling seed of requests that name none (-1 = a fresh random "
       "seed per request)", ("-s", "--seed"), (), metavar="SEED", group="engine", is_mutable=True),
    # sampling defaults (issue 46): a request's own field wins, then these, then the checkpoint's own
    # (generation_config.json / GGUF general.sampling.*), then llama-server's (unset = fall through)
    _s("default_temperature", number(minimum=0), None, "temperature of requests that send none, over the "
       "checkpoint's own (else 0.8; 0 = greedy)", ("--temp", "--temperature"), "LLAMA_ARG_TEMP", metavar="N",
       group="sampling", is_mutable=True),
    _s("default_top_k", INT, None, "top-k of requests that send none, over the checkpoint's own (else 40; <= 0 = "
       "off)", ("--top-k",), "LLAMA_ARG_TOP_K", metavar="N", group="sampling", is_mutable=True),
    _s("default_top_p", number(is_positive=True, maximum=1), None, "top-p of requests that send none, over the "
       "checkpoint's own (else 0.95; 1 = off)", ("--top-p",), "LLAMA_ARG_TOP_P", metavar="N", group="sampling",
       is_mutable=True),
    _s("default_min_p", number(minimum=0, maximum=1), None, "min-p of requests that send none, over the "
       "checkpoint's own (else 0.05; 0 = off)", ("--min-p",), "LLAMA_ARG_MIN_P", metavar="N", group="sampling",
       is_mutable=True),
    _s("default_repeat_last_n", integer(minimum=-1), None, "tokens the penalties look back over, for requests that "
       "send none, over the checkpoint's own (else 64; -1 = the whole context, 0 = off)", ("--repeat-last-n",),
       "LLAMA_ARG_REPEAT_LAST_N", metavar="N", group="sampling", is_mutable=True),
    _s("default_repeat_penalty", number(is_positive=True), None, "repeat penalty of requests that send none, over "
       "the checkpoint's own (else 1 = off)", ("--repeat-penalty",), "LLAMA_ARG_REPEAT_PENALTY", metavar="N",
       group="sampling", is_mutable=True),
    _s("default_presence_penalty", number(), None, "presence penalty of requests that send none (else 0 = off)",
       ("--presence-penalty",), "LLAMA_ARG_PRESENCE_PENALTY", metavar="N", group="sampling", is_mutable=True),
    _s("default_frequency_penalty", number(), None, "frequency penalty of requests that send none (else 0 = off)",
       ("--frequency-penalty",), "LLAMA_ARG_FREQUENCY_PENALTY", metavar="N", group="sampling", is_mutable=True),
    _s("decode_timeout", SECONDS, 600.0, "abort a request that produces no token for this long (not applied to "
       "prefill); a Florence-2 request gets this long for its whole answer (504)", ("--decode-timeout",), "LLAMA_ARG_DECODE_TIMEOUT", metavar="SECONDS", group="engine",
       is_mutable=True),
    # speculative decoding (B1-B4)
    _s("draft_kind", choice(*DRAFT_KINDS), "none", "speculative decoding: none, prompt-lookup (n-grams of the "
       "request's own context), full-model (--draft-model) or dflash (a DFlash drafter checkpoint as --draft-model)",
       ("--draft-kind",), "MLXCEL_DRAFT_KIND", group="speculative"),
    _s("draft_max", integer(minimum=1), 16, "most draft tokens verified per round",
       ("--draft-max", "--draft", "--draft-n"), "LLAMA_ARG_DRAFT_MAX", metavar="N", group="speculative"),
    _s("draft_min", integer(minimum=0), 0, "shorter drafts are not verified (the row decodes plainly)",
       ("--draft-min", "--draft-n-min"), "LLAMA_ARG_DRAFT_MIN", metavar="N", group="speculative"),
    _s("prompt_lookup_max_batch", integer(minimum=1), 2, "speculate only while at most N requests run (rows over "
       "it decode plainly)", ("--prompt-lookup-max-batch",), "MLXCEL_PROMPT_LOOKUP_MAX_BATCH", metavar="N",
       group="speculative"),
    _s("prompt_lookup_ngram", integer(minimum=1), 3, "longest context suffix (tokens) prompt lookup matches",
       ("--prompt-lookup-ngram",), "MLXCEL_PROMPT_LOOKUP_NGRAM", metavar="N", group="speculative"),
    _s("draft_block_size", integer(minimum=1), 16, "tokens a DFlash drafter proposes per block",
       ("--draft-block-size",), "MLXCEL_DRAFT_BLOCK_SIZE", metavar="N", group="speculative"),
    _s("mtp", choice(*MTP_MODES), "auto", "drafting with the checkpoint's own MTP layers (F10; MiMo, Qwen3.5, Qwen3-Next) while one "
       "request runs: auto (profile, then keep the faster), on or off; GET /v1/internal/mtp-policy reports it",
       ("--mtp",), "MLXCEL_MTP", group="speculative"),
    # block-diffusion text models (U): a DiffusionGemma -m is served by a serial worker
    _s("diffusion_sampler", choice("entropy-bound", "confidence"), "entropy-bound", "which denoised tokens a "
       "block-diffusion step accepts: entropy-bound (the lowest-entropy tokens whose summed entropy stays under "
       "--diffusion-threshold) or confidence (every token whose probability reaches --diffusion-threshold)",
       ("--diffusion-sampler",), "MLXCEL_DIFFUSION_SAMPLER", metavar="NAME", group="diffusion"),
    _s("diffusion_threshold", number(is_positive=True), None, "the sampler's threshold: the entropy bound, or a "
       "probability in (0, 1] for confidence (unset: the checkpoint's, 0.9 for confidence)",
       ("--diffusion-threshold",), "MLXCEL_DIFFUSION_THRESHOLD", metavar="N", group="diffusion"),
    _s("max_denoising_steps", integer(minimum=0), 0, "most denoising steps per block (0 = the checkpoint's "
       "generation_config.json)", ("--max-denoising-steps",), "MLXCEL_MAX_DENOISING_STEPS", metavar="N",
       group="diffusion"),
    _s("diffusion_request_timeout", SECONDS, 300.0, "block-diffusion request deadline from admission (queued or "
       "running) before 504", ("--diffusion-request-timeout",), "MLXCEL_DIFFUSION_REQUEST_TIMEOUT",
       metavar="SECONDS", group="diffusion"),
    _s("slot_save_path", TEXT, None, "folder for POST /slots/ID?action=save|restore", ("--slot-save-path",),
       "LLAMA_ARG_SLOT_SAVE_PATH", metavar="PATH", group="engine"),
    # server
    _s("host", TEXT, "127.0.0.1", "address to bind; a path ending in .sock serves a Unix socket", ("--host",),
       "LLAMA_ARG_HOST"),
    _s("port", integer(minimum=0), 8080, "TCP port (0 = any free port; the real one is logged)", ("--port",),
       "LLAMA_ARG_PORT"),
    _s("api_key", TEXT, None, "require this key (several: comma-separated) as Bearer token or X-Api-Key",
       ("--api-key",), "LLAMA_API_KEY", metavar="KEY", is_secret=True),
    _s("api_key_file", PATH, None, "read API keys from a file, one per line", ("--api-key-file",), metavar="PATH"),
    _s("timeout", SECONDS, 3600.0, "HTTP read/write timeout", ("-to", "--timeout"), "LLAMA_ARG_TIMEOUT",
       metavar="SECONDS"),
    _s("max_body_size", SIZE, 32 << 20, "largest request body (e.g. 32M); larger ones get 413",
       ("--max-body-size",), "LLAMA_ARG_MAX_BODY_SIZE", metavar="SIZE"),
    _s("sse_keepalive", SECONDS, 15.0, "seconds of silence before an SSE keepalive comment", ("--sse-keepalive",),
       metavar="SECONDS"),
    _s("endpoint_slots", BOOL, True, "serve /slots", (Flag(("--slots",), "on", "serve /slots (default: on)"),
                                                      Flag(("--no-slots",), "off", "do not serve /slots")),
       "LLAMA_ARG_ENDPOINT_SLOTS"),
    _s("endpoint_props", BOOL, False, "serve /props", ("--props",), "LLAMA_ARG_ENDPOINT_PROPS", action="on"),
    _s("endpoint_metrics", BOOL, False, "serve Prometheus /metrics", ("--metrics",), "LLAMA_ARG_ENDPOINT_METRICS",
       action="on"),
    _s("webui", BOOL, False, "serve the admin web UI at /webui/ and its control plane /ui-api/v1 (without -m the "
       "server starts model-less; loopback only unless --api-key and TLS are given)", ("--webui",), "MLXCEL_WEBUI",
       action="on"),
    _s("api_prefix", TEXT, "", "mount every route under this prefix (e.g. /llm)", ("--api-prefix",),
       "LLAMA_ARG_API_PREFIX", metavar="PREFIX"),
    _s("cors_origins", TEXT, None, "browser origins allowed to call the server (comma-separated, or *); other "
       "origins get 403; clients sending no Origin are accepted", ("--cors-origins", "--allowed-origins"),
       "MLXCEL_CORS_ORIGINS", metavar="ORIGINS"),
    _s("ssl_key_file", PATH, None, "PEM private key: serve HTTPS", ("--ssl-key-file",), "LLAMA_ARG_SSL_KEY_FILE",
       metavar="PATH"),
    _s("ssl_cert_file", PATH, None, "PEM certificate chain: serve HTTPS", ("--ssl-cert-file",),
       "LLAMA_ARG_SSL_CERT_FILE", metavar="PATH"),
    _s("anthropic_pin_billing_stamp", BOOL, True, "pin Claude Code's per-request billing stamp so the prefix "
       "cache keeps hitting (E2)", (), "MLXCEL_ANTHROPIC_PIN_BILLING_STAMP"),
    _s("responses_db", PATH, None, "SQLite file keeping stored /v1/responses (default: <models dir or "
       "~/.cache/mlxcel>/responses.sqlite3)", ("--responses-db",), "MLXCEL_RESPONSES_DB", metavar="PATH"),
    _s("stream_buffer_streams", INT, 64, "finished resumable streams kept for GET /v1/stream (F6)",
       ("--stream-buffer-streams",), "MLXCEL_STREAM_BUFFER_STREAMS", metavar="N"),
    _s("stream_buffer_bytes", SIZE, 4 << 20, "SSE events kept per resumable stream (e.g. 4M); older events are "
       "dropped first", ("--stream-buffer-bytes",), "MLXCEL_STREAM_BUFFER_BYTES", metavar="SIZE"),
    _s("stream_buffer_ttl", number(), 300.0, "seconds a resumable stream is kept after its last event; a running "
       "one nobody reads is cancelled then", ("--stream-buffer-ttl",), "MLXCEL_STREAM_BUFFER_TTL",
       metavar="SECONDS"),
    # embeddings and rerank (spec I)
    _s("embedding_model", TEXT, None, "embedding checkpoint served beside the chat model on /v1/embeddings, "
       "/embedding(s)", ("--embedding-model",), "LLAMA_ARG_EMBEDDING_MODEL", metavar="MODEL", group="side"),
    _s("reranker_model", TEXT, None, "reranker served on /v1/rerank: a 1-label sequence classifier, or a causal "
       "LM scored by yes/no (the same path as -m: a rerank-only process)", ("--reranker-model",),
       "LLAMA_ARG_RERANKER_MODEL", metavar="MODEL", group="side"),
    _s("embedding_batch_size", COUNT, 16, "inputs per embedding forward", ("--embedding-batch-size",),
       "LLAMA_ARG_EMBEDDING_BATCH_SIZE", metavar="N", group="side"),
    _s("rerank_batch_size", NON_NEGATIVE, 0, "pairs per rerank forward (0 = 8 text pairs)",
       ("--rerank-batch-size",), "LLAMA_ARG_RERANK_BATCH_SIZE", metavar="N", group="side"),
    _s("embedding_queue_depth", NON_NEGATIVE, 8, "requests waiting per embedding/rerank worker before 503",
       ("--embedding-queue-depth",), "LLAMA_ARG_EMBEDDING_QUEUE_DEPTH", metavar="N", group="side"),
    _s("embedding_request_timeout", SECONDS, 120.0, "embedding/rerank request deadline before 504",
       ("--embedding-request-timeout-secs",), "LLAMA_ARG_EMBEDDING_REQUEST_TIMEOUT_SECS", metavar="SECONDS",
       group="side"),
    _s("pooling", choice("mean", "cls", "last", "none"), None, "override the checkpoint's pooling", ("--pooling",),
       "LLAMA_ARG_POOLING", group="side"),
    _s("embd_normalize", INT, None, "override the normalization: -1 none, 0 int16 max-abs, 1 taxicab, "
       "2 euclidean, >2 p-norm", ("--embd-normalize",), "LLAMA_ARG_EMBD_NORMALIZE", metavar="N", group="side"),
    _s("embeddings_mode", BOOL, False, "restricted mode: serve embeddings only (needs an embedding model)",
       ("--embedding", "--embeddings"), "LLAMA_ARG_EMBEDDINGS", group="side", action="on"),
    _s("reranking_mode", BOOL, False, "restricted mode: serve reranking only (needs a reranker)",
       ("--rerank", "--reranking"), "LLAMA_ARG_RERANKING", group="side", action="on"),
    # image generation (spec J)
    _s("image_model", TEXT, None, "diffusers pipeline folder (or repo id) served on /v1/images/generations and "
       "/v1/images/edits beside the chat model; without -m an image-only process", ("--image-model",),
       "MLXCEL_IMAGE_MODEL", metavar="CHECKPOINT", group="image"),
    _s("image_queue_depth", COUNT, 4, "image requests waiting before 503 (one runs at a time)",
       ("--image-queue-depth",), "MLXCEL_IMAGE_QUEUE_DEPTH", metavar="N", group="image"),
    _s("image_request_timeout", SECONDS, 300.0, "image request deadline before 504",
       ("--image-request-timeout-secs",), "MLXCEL_IMAGE_REQUEST_TIMEOUT_SECS", metavar="SECONDS", group="image"),
    # media input (C2-C5)
    _s("media_path", PATH, None, "folder local media (file:// URLs, bare names) may be read from; without it "
       "local media is refused", ("--media-path",), "LLAMA_ARG_MEDIA_PATH", metavar="DIR", group="media"),
    _s("max_image_payload_size", size(is_positive=True), None, "largest image payload (e.g. 20M; default 20M)",
       ("--max-image-payload-size",), "LLAMA_ARG_MAX_IMAGE_PAYLOAD_SIZE", metavar="SIZE", group="media"),
    _s("max_images", COUNT, None, "most images per request, video frames included (default 32)", ("--max-images",),
       "LLAMA_ARG_MAX_IMAGES", metavar="N", group="media"),
    _s("video_max_frames", COUNT, None, "frames kept per video block (default 16)", ("--video-max-frames",),
       "MLXCEL_VIDEO_MAX_FRAMES", metavar="N", group="media"),
    _s("video_fps", number(is_positive=True), None, "video sampling rate when a block gives none (default 2.0)",
       ("--video-fps",), "MLXCEL_VIDEO_FPS", metavar="FPS", group="media"),
    _s("video_dir_allowlist", DIR_ALLOWLIST, None, "folders local video paths may come from (C5)", (),
       "MLXCEL_VIDEO_DIR_ALLOWLIST", group="media"),
    _s("allow_private_media_urls", BOOL, False, "skip the media address checks (C3)", (),
       "MLXCEL_ALLOW_PRIVATE_MEDIA_URLS", group="media"),
    # audio-only processes (spec G)
    _s("audio_queue_depth", NON_NEGATIVE, 8, "audio requests waiting before 503", ("--audio-queue-depth",),
       "MLXCEL_AUDIO_QUEUE_DEPTH", metavar="N", group="audio"),
    _s("audio_request_timeout", SECONDS, 120.0, "audio request deadline before 504",
       ("--audio-request-timeout-secs",), "MLXCEL_AUDIO_REQUEST_TIMEOUT_SECS", metavar="SECONDS", group="audio"),
    _s("audio_max_upload_size", size(is_positive=True), None, "largest audio upload before 413 (default 25M)",
       ("--audio-max-upload-size",), "MLXCEL_AUDIO_MAX_UPLOAD_SIZE", metavar="SIZE", group="audio"),
    _s("audio_max_duration", SECONDS, 600.0, "longest audio accepted for transcription before 400",
       ("--audio-max-duration-secs",), "MLXCEL_AUDIO_MAX_DURATION_SECS", metavar="SECONDS", group="audio"),
    _s("audio_beam_size", COUNT, 5, "Whisper beam size", ("--audio-beam-size",), "MLXCEL_AUDIO_BEAM_SIZE",
       metavar="N", group="audio"),
    # realtime voice sessions (spec H)
    _s("realtime_stt", TEXT, None, "with --realtime-tts: serve /v1/realtime as a cascade of this Whisper "
       "checkpoint, -m (the chat model) and the voice; chat routes then answer 501", ("--realtime-stt",),
       "MLXCEL_REALTIME_STT", metavar="MODEL", group="realtime"),
    _s("realtime_tts", TEXT, None, "the Kokoro or Piper voice of the /v1/realtime cascade", ("--realtime-tts",),
       "MLXCEL_REALTIME_TTS", metavar="MODEL", group="realtime"),
    # logging
    _s("verbose", BOOL, False, "debug logging (changeable at run time: the log level follows it)",
       ("-v", "--verbose"), group="logging", action="on", is_mutable=True),
    _s("log_file", PATH, None, "also write the log to this file", ("--log-file",), "LLAMA_LOG_FILE",
       metavar="PATH", group="logging"),
)

GENERATE_SETTINGS: tuple[Setting, ...] = (
    _s("prompt", TEXT, None, "the prompt text (required)", ("-p", "--prompt"), metavar="TEXT", group="generate"),
    _s("chat", BOOL, False, "wrap the prompt as a user message in the chat template", ("--chat",),
       group="generate", action="on"),
    _s("max_tokens", COUNT, 256, "most tokens to generate", ("-n", "--max-tokens"), metavar="N", group="generate"),
    _s("temperature", number(), 0.0, "sampling temperature (0 = greedy)", ("--temp",), metavar="T",
       group="generate"),
    _s("seed", INT, None, "sampling seed", ("--seed",), metavar="S", group="generate"),
    _s("audio", PATH, None, "audio file in: transcribed by a Whisper -m, or the spoken turn of a "
       "--realtime-stt/--realtime-tts cascade", ("--audio",), metavar="WAV", group="generate"),
    _s("output_audio", PATH, None, "write speech here: the -p text spoken by a Kokoro/Piper -m, or the cascade's "
       "spoken answer", ("--output-audio",), metavar="WAV", group="generate"),
)

# `mlxcel perplexity` (issue 27): llama-perplexity's flags; the model, device, dtype, threads, quantize and KV
# records are serve's, so the run takes the server's decode path.
PERPLEXITY_SETTINGS: tuple[Setting, ...] = (
    _s("text_file", PATH, None, "the text to score (required unless --kl-divergence reads a base's own tokens)",
       ("-f", "--file"), metavar="FILE", group="perplexity"),
    _s("ppl_ctx", integer(minimum=4), 512, "tokens per chunk; the second half of each is scored (llama-perplexity's -c)",
       ("-c", "--ctx-size"), metavar="N", group="perplexity"),
    _s("chunks", INT, -1, "most chunks to score (-1 = every whole chunk of the text)", ("--chunks",), metavar="N",
       group="perplexity"),
    _s("kl_divergence_base", PATH, None, "llama.cpp's logits file: written by this run, or read with "
       "--kl-divergence", ("--kl-divergence-base", "--save-all-logits"), metavar="FILE", group="perplexity"),
    _s("kl_divergence", BOOL, False, "compare with the --kl-divergence-base file (its tokens and -c): KLD, same top "
       "token, RMS Δp, PPL ratio", ("--kl-divergence",), group="perplexity", action="on"),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS + GENERATE_SETTINGS + PERPLEXITY_SETTINGS}
BY_ENV: dict[str, Setting] = {env: s for s in SETTINGS for env in s.env}


def read_environment(environ: Mapping[str, str], settings: Iterable[Setting] = SETTINGS) -> dict[str, Any]:
    """The value of every setting whose mirror is set in `environ` (first mirror wins); SettingError if bad."""
    values: dict[str, Any] = {}
    for setting in settings:
        for env in setting.env:
            if env in environ:
                values[setting.name] = setting.parse(environ[env])
                break
    return values


def defaults(settings: Iterable[Setting] = SETTINGS) -> dict[str, Any]:
    return {s.name: s.default for s in settings}


def markdown_table(settings: Iterable[Setting] = SETTINGS) -> str:
    """The README's settings reference, generated from the table (a test keeps README equal to it)."""
    rows = ["| Setting | Flags | Environment | Default | Runtime | What it does |", "|---|---|---|---|---|---|"]
    for s in settings:
        flags = ", ".join(f"`{name}`" for flag in s.flags for name in flag.names)
        env = ", ".join(f"`{name}`" for name in s.env)
        default = "" if s.default in (None, "") or s.is_secret else f"`{plain(s.default)}`"
        text = s.help.replace("|", "\\|")
        rows.append(f"| `{s.name}` | {flags} | {env} | {default} | {'PATCH' if s.is_mutable else ''} | {text} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python -m mlxcel.settings > table.md
    print(markdown_table(), end="")


# ---- run-time values (F9) ----

@dataclass(frozen=True, slots=True)
class Rejection:
    """A PATCH name that was not applied: code unknown_setting | read_only_setting | invalid_value."""

    name: str
    code: str
    message: str


class LiveSettings:
    """The process's setting values: the startup ones, with mutable ones changed by PATCH (F9).

    `patch` validates each name on its own and applies the valid ones even when another is
    rejected (a rejected name never rolls back a valid one); `apply(name, value)` is what makes
    a change take effect (the server's appliers); its ValueError rejects that name alone.
    """

    def __init__(self, values: Mapping[str, Any] | None = None, settings: Iterable[Setting] = SETTINGS) -> None:
        self.settings = {s.name: s for s in settings}
        self.startup = {**defaults(self.settings.values()), **(values or {})}
        self.current = dict(self.startup)

    def observe(self, name: str, value: Any) -> None:
        """Record the value the served engine was started with (A3's one-slot clamp; an engine built from other
        values) as the startup one; a value PATCHed since stays current (the caller applies it again)."""
        is_patched = self.current[name] != self.startup[name]
        self.startup[name] = value
        if not is_patched:
            self.current[name] = value

    def snapshot(self) -> dict[str, Any]:
        """Every current value as JSON shows it; secrets as null."""
        return {name: None if s.is_secret else plain(self.current[name]) for name, s in self.settings.items()}

    def schema(self) -> dict[str, Any]:
        return {name: s.schema() for name, s in self.settings.items()}

    def fingerprint(self) -> str:
        """A stable hash of the mutable values: it changes exactly when one of them does."""
        import hashlib

        mutable = {n: plain(self.current[n]) for n, s in sorted(self.settings.items()) if s.is_mutable}
        digest = hashlib.sha256(json.dumps(mutable, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        return f"sha256:{digest[:32]}"

    def patch(self, changes: Mapping[str, Any], apply: Callable[[str, Any], None], *, is_replace: bool = False
              ) -> tuple[dict[str, Any], list[Rejection]]:
        """Merge `changes` (or, with `is_replace`, reset every unnamed mutable setting to its startup value)."""
        wanted = dict(changes)
        if is_replace:
            for name, s in self.settings.items():
                if s.is_mutable and name not in wanted:
                    wanted[name] = self.startup[name]
        applied: dict[str, Any] = {}
        rejected: list[Rejection] = []
        for name, raw in wanted.items():
            outcome = self._patch_one(name, raw, apply, is_from_body=name in changes)
            if isinstance(outcome, Rejection):
                rejected.append(outcome)
            elif outcome is not _UNCHANGED:
                applied[name] = plain(self.current[name])
        return applied, rejected

    def _patch_one(self, name: str, raw: Any, apply: Callable[[str, Any], None], *, is_from_body: bool) -> Any:
        setting = self.settings.get(name)
        if setting is None:
            return Rejection(name, "unknown_setting", f"{name}: no such setting (GET /v1/settings lists them)")
        if setting.is_secret and raw is None:
            return _UNCHANGED  # GET shows a secret as null; sending that back keeps it
        try:
            value = setting.parse_json(raw) if is_from_body else raw
        except SettingError as exc:
            return Rejection(name, "invalid_value", str(exc))
        if value == self.current[name]:
            return _UNCHANGED  # a round trip of GET's values (read-only ones included) changes nothing
        if not setting.is_mutable:
            flags = ", ".join([f.names[0] for f in setting.flags[:1]] + list(setting.env[:1]))
            return Rejection(name, "read_only_setting", f"{setting.label} is read-only at run time: set it at "
                             f"startup ({flags or 'no flag'}) and restart")
        try:
            apply(name, value)
        except ValueError as exc:
            return Rejection(name, "invalid_value", f"{setting.label}: {exc}")
        self.current[name] = value
        return value


_UNCHANGED = object()
