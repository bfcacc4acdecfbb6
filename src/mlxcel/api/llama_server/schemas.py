"""llama-server native request bodies (F4): /completion, /infill, /tokenize, /detokenize, /apply-template.

Fields keep llama-server's names and defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05,
n_predict -1 = until the context is full, seed -1 = random). Only what is read is declared;
unknown fields are ignored. `prompt` and `logit_bias` take several JSON shapes and are checked
by the adapter with messages naming the bad element.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from mlxcel.api.schema import MAX_SEED, ChatFeatureFields, ChatRole, LoraEntry, WireModel
from mlxcel.api.llama_samplers import LlamaSamplerFields

MAX_N_PROBS = 20
RANDOM_SEED = -1
UINT32_RANDOM_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: what llama-server reports for "random"


class CompletionFields(ChatFeatureFields, LlamaSamplerFields):
    """The /completion options shared with /infill, by llama-server's names (the reasoning
    budget, json_schema / grammar and loop-guard fields come from ChatFeatureFields)."""

    n_predict: int | None = Field(None, ge=-1)
    max_tokens: int | None = Field(None, ge=-1)  # llama-server reads it when n_predict is absent
    stream: bool = False
    temperature: float = 0.8  # <= 0 is greedy
    top_k: int = 40  # <= 0 disables
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, gt=0.0)
    repeat_last_n: int = Field(64, ge=-1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = Field(RANDOM_SEED, ge=RANDOM_SEED, le=MAX_SEED)
    logit_bias: list[Any] | dict[str, Any] | None = None
    ignore_eos: bool = False
    n_probs: int = Field(0, ge=0, le=MAX_N_PROBS)
    post_sampling_probs: bool = False  # n_probs as probabilities after the sampler chain
    stop: str | list[str] = Field(default_factory=list)
    cache_prompt: bool = True
    id_slot: int = Field(-1, ge=-1)
    return_tokens: bool = False
    timings_per_token: bool = False  # each stream event carries `timings`
    return_progress: bool = False  # a stream gets a `prompt_progress` event per prefill chunk
    response_fields: list[str] = Field(default_factory=list)  # "a/b" paths the final reply keeps
    model: str | None = None
    response_format: dict[str, Any] | None = None  # json_object, json_schema (V)
    lora: list[LoraEntry] | None = None  # per-request adapter scales [{id, scale}] (F8)

    @property
    def num_predict(self) -> int:
        """n_predict, else max_tokens, else -1 (llama-server's order)."""
        for value in (self.n_predict, self.max_tokens):
            if value is not None:
                return value
        return -1

    @property
    def stop_words(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(CompletionFields):
    """POST /completion and /completions: a string, token ids, a mixed list, or several prompts."""

    prompt: Any

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if value is None:
            raise ValueError("prompt: a string, an array of token ids, or an array of prompts is required")
        return value


class ExtraChunk(WireModel):
    """One `input_extra` item of /infill: a neighbouring file's name and text."""

    filename: str = "tmp"
    text: str = ""


class InfillRequest(CompletionFields):
    """POST /infill: the code around the hole, extra files, and text to start the middle with."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    prompt: str = ""


class DetokenizeRequest(WireModel):
    tokens: list[int] = Field(default_factory=list)


class TemplatePart(WireModel):
    """One part of a message's content array; only text parts can be rendered."""

    type: str
    text: str | None = None


class TemplateMessage(WireModel):
    """A chat turn in the /v1/chat/completions shape (the same fields the chat route reads)."""

    role: ChatRole
    content: str | list[TemplatePart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class TokenizeRequest(WireModel):
    """llama-server's `content`, or vLLM's `prompt` (text) or `messages` (rendered by the chat template
    first); exactly one. BOS is added by `add_special` / vLLM's `add_special_tokens`; by default only
    for a vLLM `prompt`, as vLLM does."""

    content: str | None = None
    prompt: str | None = None
    messages: list[TemplateMessage] | None = Field(None, min_length=1)
    add_special: bool | None = None
    add_special_tokens: bool | None = None
    parse_special: bool = True
    with_pieces: bool = False
    return_token_strs: bool = False  # vLLM: the tokens' vocabulary spellings beside the ids
    tools: list[dict[str, Any]] | None = None  # with messages, as /apply-template reads them
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_input(self) -> TokenizeRequest:
        given = [name for name in ("content", "prompt", "messages") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("content: send one of `content` (llama-server), `prompt` or `messages` (vLLM); "
                             f"got {' and '.join(given) or 'none'}")
        if self.continue_final_message and self.add_generation_prompt and self.messages is not None:
            raise ValueError("continue_final_message: set add_generation_prompt to false with it")
        return self

    @property
    def adds_special_tokens(self) -> bool:
        for value in (self.add_special_tokens, self.add_special):
            if value is not None:
                return value
        return self.prompt is not None


class ApplyTemplateRequest(ChatFeatureFields):
    """POST /apply-template: the chat fields that shape the rendered prompt."""

    messages: list[TemplateMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None  # checked as chat checks it (V), though nothing is generated
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_continue(self) -> ApplyTemplateRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: set add_generation_prompt to false with it")
        return self
