"""What a protocol adapter may use: the served model's engine client, tokenizer, template, telemetry.

The server builds one `ApiContext` per loaded model; adapters never see the web framework or
the engine's internals (DESIGN.md dependency rule: server -> api -> {text, engine client}).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from mlxcel.api.control import CompletionControls
from mlxcel.api.sse import KEEPALIVE_INTERVAL_S
from mlxcel.chat.plan import ChatFeatures
from mlxcel.engine.client import EngineClient
from mlxcel.lora_registry import LoraRegistry
from mlxcel.media.limits import MediaPolicy
from mlxcel.text.chat_template import ChatTemplate
from mlxcel.text.tokenizer import Tokenizer
from mlxcel.types import Usage


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


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """The server's sampling defaults (--temp, --top-k, ...; settings `default_<name>`): None = unset, where
    each protocol keeps its own default. A request's own field always wins."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_last_n: int | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def pick(self, name: str, sent: Any, protocol_default: Any) -> Any:
        """The request's value when it sent one, else the server's when set, else the protocol's."""
        if sent is not None:
            return sent
        server = getattr(self, name)
        return protocol_default if server is None else server

    def values(self) -> dict[str, Any]:
        """The defaults the server sets, by their llama-server field names."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def params(self, *names: str) -> dict[str, Any]:
        """The set defaults among `names` as SamplingParams fields (for fields a protocol has no name for)."""
        return {_PARAM_NAMES.get(name, name): value for name, value in self.values().items() if name in names}


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

