"""What a protocol adapter may use: the served model's engine client, tokenizer, template, telemetry.

The server builds one `ApiContext` per loaded model; adapters never see the web framework or
the engine's internals (DESIGN.md dependency rule: server -> api -> {text, engine client}).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from mlxcel.api.control import CompletionControls
from mlxcel.api.sse import KEEPALIVE_INTERVAL_S
from mlxcel.chat.plan import ChatFeatures
from mlxcel.engine.client import EngineClient
from mlxcel.lora_registry import LoraRegistry
from mlxcel.media.limits import MediaPolicy
from mlxcel.text.chat_template import ChatTemplate
from mlxcel.text.tokenizer import Tokenizer
from mlxcel.types import ImagePrompter, Usage


@dataclass(frozen=True, slots=True)
class SequenceRecord:
    """One finished engine sequence, as llama-server's `llamacpp:*` metrics count it (K2)."""

    num_prompt_tokens: int  # computed, cache hits excluded
    num_cached_tokens: int
    prompt_s: float  # submit to first token
    num_predicted_tokens: int
    decode_s: float  # first token to last: num_predicted_tokens - 1 decode steps


class Telemetry(Protocol):
    """Where adapters report what /metrics counts (K2)."""

    def observe_first_token(self, seconds: float) -> None: ...

    def observe_inter_token(self, seconds: float) -> None: ...

    def record_completed_request(self, usage: Usage) -> None:
        """One request counted by mlxcel_requests_total / mlxcel_completion_tokens_total (K2)."""

    def record_sequence(self, record: SequenceRecord) -> None:
        """One engine sequence ended (finished or aborted), whatever the protocol."""

    def record_failed_request(self, reason: str) -> None:
        """Issue 44: one request ended by an error ("internal", "engine" or "timeout")."""


class NullTelemetry:
    """Telemetry that records nothing (the CLI's one-shot generate, unit tests)."""

    def observe_first_token(self, seconds: float) -> None:
        return None

    def observe_inter_token(self, seconds: float) -> None:
        return None

    def record_completed_request(self, usage: Usage) -> None:
        return None

    def record_sequence(self, record: SequenceRecord) -> None:
        return None

    def record_failed_request(self, reason: str) -> None:
        return None


_PARAM_NAMES = {"repeat_penalty": "repetition_penalty"}  # llama-server's name -> SamplingParams'
# llama-server's built-in sampling defaults (common.h): the last layer, by llama-server's field names
LLAMA_SERVER_SAMPLING: Mapping[str, Any] = MappingProxyType({
    "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_last_n": 64, "repeat_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0})
SAMPLER_NAMES = tuple(LLAMA_SERVER_SAMPLING)  # each also the setting `default_<name>` (--temp, --top-k, ...)


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request that leaves a sampling field out gets (issue 46), in vLLM's and llama-server's order: the
    server's flags (--temp, --top-k, ...; settings `default_<name>`, None = unset), then the checkpoint's own
    (`checkpoint`: generation_config.json or GGUF general.sampling.*), then llama-server's built-in defaults.
    A request's own field always wins."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_last_n: int | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    checkpoint: Mapping[str, Any] = field(default_factory=dict)  # by llama-server's field names

    def pick(self, name: str, sent: Any) -> Any:
        """The request's value when it sent one, else the default `name` has."""
        return self.value(name) if sent is None else sent

    def value(self, name: str) -> Any:
        server = getattr(self, name)
        if server is not None:
            return server
        return self.checkpoint.get(name, LLAMA_SERVER_SAMPLING[name])

    def source(self, name: str) -> str:
        """Where the default of `name` comes from: "server" (a flag or PATCH), "checkpoint" or "llama-server"."""
        if getattr(self, name) is not None:
            return "server"
        return "checkpoint" if name in self.checkpoint else "llama-server"

    def values(self) -> dict[str, Any]:
        """Every sampler default, by its llama-server field name."""
        return {name: self.value(name) for name in SAMPLER_NAMES}

    def sources(self) -> dict[str, dict[str, Any]]:
        """Each default's value and where it came from, as /props and /v1/settings show them."""
        return {name: {"value": self.value(name), "source": self.source(name)} for name in SAMPLER_NAMES}

    def params(self, *names: str) -> dict[str, Any]:
        """The defaults of `names` as SamplingParams fields (for fields a protocol has no name for)."""
        return {_PARAM_NAMES.get(name, name): self.value(name) for name in names}


@dataclass(frozen=True, slots=True)
class ApiContext:
    """The served chat model as the API layer sees it."""

    model_name: str
    engine: EngineClient
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    context_size: int  # per slot
    created: int  # unix time the model was loaded (the `created` of /v1/models)
    features: ChatFeatures  # reasoning, tools, grammar, budget, echo (S-V), built with the model (serving.served_model)
    telemetry: Telemetry = field(default_factory=NullTelemetry)
    sse_keepalive_s: float = KEEPALIVE_INTERVAL_S
    media_policy: MediaPolicy = field(default_factory=MediaPolicy)  # C2-C5: api.media.validate_media reads it
    controls: CompletionControls = field(default_factory=CompletionControls)  # F5: running chat completions
    aliases: tuple[str, ...] = ()  # --alias names (the model_name among them); /v1/models lists them
    tags: tuple[str, ...] = ()  # --tags
    lora: LoraRegistry = field(default_factory=LoraRegistry)  # F8: adapters and global scales
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)  # F9: replaced when PATCHed
    image_marker: str | None = None  # U: the text an image_url part renders as; None = images are refused (400)
    weights: Mapping[str, Any] = field(default_factory=dict)  # issue 42: format, bits, resident bytes (/v1/models)
    image_prompter: ImagePrompter | None = None  # issue 43: expands markers and processes images (models/_vision.py)

