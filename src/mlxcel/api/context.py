"""What a protocol adapter may use: the served model's engine client, tokenizer, template, telemetry.

The server builds one `ApiContext` per loaded model; adapters never see the web framework or
the engine's internals (DESIGN.md dependency rule: server -> api -> {text, engine client}).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

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


@dataclass(frozen=True, slots=True)
class ApiContext:
    """The served chat model as the API layer sees it."""

    model_name: str
    engine: EngineClient
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    context_size: int  # per slot
    created: int  # unix time the model was loaded (the `created` of /v1/models)
    features: ChatFeatures  # reasoning, tools, grammar, budget, echo (S-V), built with the model (runtime.py)
    telemetry: Telemetry = field(default_factory=NullTelemetry)
    sse_keepalive_s: float = KEEPALIVE_INTERVAL_S
    media_policy: MediaPolicy = field(default_factory=MediaPolicy)  # C2-C5: api.media.validate_media reads it
    controls: CompletionControls = field(default_factory=CompletionControls)  # F5: running chat completions
    aliases: tuple[str, ...] = ()  # --alias names (the model_name among them); /v1/models lists them
    tags: tuple[str, ...] = ()  # --tags
    lora: LoraRegistry = field(default_factory=LoraRegistry)  # F8: adapters and global scales

