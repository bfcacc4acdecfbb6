"""OpenAI request bodies (chat completions, completions) with the llama-server and vLLM extras.

Only what is read is declared; other fields are ignored (unknown fields never fail a request).
Types are strict: `"max_tokens": "5"` is a 400, as with OpenAI.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from mlxcel.api.schema import MAX_SEED, MIN_SEED, ChatFeatureFields, ChatRole, LoraEntry, WireModel
from mlxcel.api.llama_samplers import LlamaSamplerFields

MAX_N = 16
MAX_TOP_LOGPROBS = 20
TOOL_CHOICES = ("auto", "none", "required")


class MediaUrl(WireModel):
    """`image_url` / `video_url` as an object; `fps` (video only) overrides --video-fps (C5)."""

    url: str
    detail: str | None = None
    fps: float | None = None


class InputAudio(WireModel):
    data: str  # base64
    format: str  # wav, mp3, ...


class ContentPart(WireModel):
    """One part of a message's content array: text, image_url, input_audio, video_url, file..."""

    type: str
    text: str | None = None
    image_url: str | MediaUrl | None = None  # a bare URL string is accepted too (as vLLM does)
    input_audio: InputAudio | None = None
    video_url: str | MediaUrl | None = None


class ChatMessage(WireModel):
    role: ChatRole
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the other spelling clients send reasoning back in (Q)


class StreamOptions(WireModel):
    include_usage: bool = False


class SamplingFields(ChatFeatureFields, LlamaSamplerFields):
    """Sampling fields shared by chat and completions (OpenAI names, then llama/vLLM extras; the
    chat-feature extensions come from ChatFeatureFields)."""

    model: str | None = None  # optional, as in llama-server and vLLM: the served model answers
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)  # what torch.manual_seed takes
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # llama-server / vLLM extras (also accepted inside extra_body)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    repeat_penalty: float | None = Field(None, gt=0.0)  # llama-server's spelling
    repeat_last_n: int | None = Field(None, ge=-1)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    cache_prompt: bool = True
    id_slot: int | None = Field(None, ge=-1)
    skip_special_tokens: bool = True
    lora: list[LoraEntry] | None = None  # llama-server: per-request adapter scales (F8)
    timings_per_token: bool = False  # llama-server: each stream chunk carries `timings`
    return_progress: bool = False  # llama-server: a stream gets a `prompt_progress` chunk per prefill chunk
    extra_body: dict[str, Any] | None = None  # lifted to the root before validation (api/schema.py)

    @model_validator(mode="after")
    def _check_best_of(self) -> SamplingFields:
        if self.best_of not in (None, 1):
            raise ValueError("best_of: only null or 1 is supported")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema (V)
    reasoning_effort: str | None = None  # a template kwarg when the template reads it (S)
    prompt_cache_key: str | None = None  # the reasoning echo's session key (Q)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_control: bool = False  # llama-server: opt in to POST /v1/chat/completions/control (F5)
    verbose: bool = False  # llama-server's debug echo: `__verbose` (the native reply, the rendered prompt)

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: set add_generation_prompt to false with it")
        if isinstance(self.tool_choice, str) and self.tool_choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice: must be one of {', '.join(TOOL_CHOICES)} or a named function, "
                             f"not {self.tool_choice!r}")
        return self


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0: the prompt alone (with echo and logprobs: its logprobs)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM: each prompt token's logprob + top N
    response_format: dict[str, Any] | None = None  # json_object, json_schema (V), as vLLM accepts here


class ControlRequest(WireModel):
    """POST /v1/chat/completions/control (F5): an action for a running chat completion."""

    id: str = Field(min_length=1)  # the completion's `chatcmpl-...` id
    action: str
    model: str | None = None  # accepted as llama-server's router needs it; the served model answers
