"""OpenAI Responses request bodies (F2, F5) and their input items, with a few llama/vLLM extras.

Only what is read is declared; unknown fields are ignored. Types are strict, as everywhere
(`"max_output_tokens": "5"` is a 400). Input items are validated one by one by their `type`
(`message` when absent, as OpenAI's "easy" messages), so an error names `input.N`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from mlxcel.api.errors import invalid_request
from mlxcel.api.schema import MAX_SEED, MIN_SEED, ChatFeatureFields, WireModel

MAX_TOP_LOGPROBS = 20
MAX_METADATA_KEYS = 16  # OpenAI's metadata limits: 16 pairs, keys up to 64 and values up to 512 chars
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


# ---- content parts ----

class TextPart(WireModel):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None


class RefusalPart(WireModel):
    type: Literal["refusal"]
    refusal: str


class ImagePart(WireModel):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["low", "high", "auto", "original"] = "auto"


class FilePart(WireModel):
    type: Literal["input_file"]
    file_id: str | None = None
    file_url: str | None = None
    file_data: str | None = None
    filename: str | None = None


class AudioPart(WireModel):
    type: Literal["input_audio"]
    input_audio: dict[str, Any] | None = None


ContentPart = Annotated[TextPart | RefusalPart | ImagePart | FilePart | AudioPart, Field(discriminator="type")]


class SummaryPart(WireModel):
    type: Literal["summary_text"]
    text: str


class ReasoningTextPart(WireModel):
    type: Literal["reasoning_text"]
    text: str


# ---- input items ----

class MessageItem(WireModel):
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(WireModel):
    type: Literal["function_call"]
    id: str | None = None
    call_id: str
    name: str
    namespace: str | None = None  # a member of a namespace tool (Codex)
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class CustomToolCallItem(WireModel):
    type: Literal["custom_tool_call"]
    id: str | None = None
    call_id: str
    name: str
    namespace: str | None = None
    input: str
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class CustomToolCallOutputItem(WireModel):
    type: Literal["custom_tool_call_output"]
    id: str | None = None
    call_id: str
    output: str | list[ContentPart]


class FunctionCallOutputItem(WireModel):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str
    output: str | list[ContentPart]
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningItem(WireModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryPart] = Field(default_factory=list)
    content: list[ReasoningTextPart] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class CompactionItem(WireModel):
    type: Literal["compaction"]
    id: str | None = None
    encrypted_content: str


class OtherItem(WireModel):
    """An item type read only as history (web_search_call, local_shell_call and its output, mcp_call...):
    kept as sent; what of it the prompt shows is items.other_item_messages' choice (issue 46)."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)

    type: str
    id: str | None = None


InputItem = (MessageItem | FunctionCallItem | FunctionCallOutputItem | CustomToolCallItem | CustomToolCallOutputItem
             | ReasoningItem | CompactionItem | OtherItem)
ITEM_MODELS: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "custom_tool_call": CustomToolCallItem,
    "custom_tool_call_output": CustomToolCallOutputItem,
    "reasoning": ReasoningItem,
    "compaction": CompactionItem,
}


def parse_input_items(value: str | Sequence[Any] | None) -> list[InputItem]:
    """`input` as typed items: a string is one user message; raises ApiError(400) naming `input.N`."""
    if value is None:
        return []
    if isinstance(value, str):
        return [MessageItem(role="user", content=value)]
    return [_parse_item(index, raw) for index, raw in enumerate(value)]


def _parse_item(index: int, raw: Any) -> InputItem:
    if not isinstance(raw, dict):
        raise invalid_request(f"input.{index}: each input item must be an object, not {type(raw).__name__}")
    kind = raw.get("type", "message")
    if kind == "item_reference":
        raise invalid_request(f"input.{index}: item_reference is not supported; send the item itself or "
                              "chain with previous_response_id")
    if not isinstance(kind, str):
        raise invalid_request(f"input.{index}.type: must be a string, not {type(kind).__name__}")
    model = ITEM_MODELS.get(kind, OtherItem)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise invalid_request(_item_errors(index, exc)) from None


def _item_errors(index: int, exc: ValidationError) -> str:
    parts = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(p) for p in ("input", index, *error["loc"]))
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


# ---- request bodies ----

class TextFormat(WireModel):
    """`text.format`: text, json_object or json_schema (enforced by the structured-output layer)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("text.format: json_schema needs a name and a schema")
        return self


class TextConfig(WireModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(WireModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed", "none"] | None = None


class ConversationFields(ChatFeatureFields):
    """What makes the prompt: shared by create, input_tokens and compact (with the chat-feature
    extensions of ChatFeatureFields: budget, loop guard, json_schema / grammar...)."""

    model: str | None = None  # optional, as on the other OpenAI routes: the served model answers
    input: str | list[Any] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    tools: list[Any] | None = None  # each checked by its type in tools.parse_tools (function, custom, namespace, hosted)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    chat_template_kwargs: dict[str, Any] | None = None  # extra: as on chat (the spec's advice for reasoning)
    prompt_cache_key: str | None = None
    extra_body: dict[str, Any] | None = None  # lifted to the root before validation (api/schema.py)

    @model_validator(mode="after")
    def _check_conversation(self) -> ConversationFields:
        if not self.input and self.previous_response_id is None:
            raise ValueError("input: at least one input item (or a previous_response_id) is required")
        if self.conversation is not None:
            raise ValueError("conversation: the Conversations API is not available on this server; "
                             "chain turns with previous_response_id")
        return self


class ResponseCreateRequest(ConversationFields):
    """POST /v1/responses."""

    store: bool = True
    background: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    max_tool_calls: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt: dict[str, Any] | None = None
    # llama-server / vLLM sampling extras (also accepted inside extra_body)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    cache_prompt: bool = True
    timings_per_token: bool = False  # llama-server: a stream step's last event carries `timings`
    return_progress: bool = False  # llama-server: a stream gets a response.in_progress event per prefill chunk

    @model_validator(mode="after")
    def _check_fields(self) -> ResponseCreateRequest:
        if self.prompt is not None:
            raise ValueError("prompt: stored prompt templates are not available on this server; send input")
        if self.background and not self.store:
            raise ValueError("background: a background response must be stored (store: true) so it can be polled")
        _check_metadata(self.metadata)
        return self

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.top_logprobs) or "message.output_text.logprobs" in (self.include or ())


class InputTokensRequest(ConversationFields):
    """POST /v1/responses/input_tokens: the prompt fields only."""


class CompactRequest(ConversationFields):
    """POST /v1/responses/compact; `max_output_tokens` (an extra) caps the summary."""

    max_output_tokens: int | None = Field(None, ge=1)


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise ValueError(f"metadata: at most {MAX_METADATA_KEYS} pairs, not {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(f"metadata[{key[:MAX_METADATA_KEY_CHARS]!r}]: keys are at most "
                             f"{MAX_METADATA_KEY_CHARS} characters and values at most {MAX_METADATA_VALUE_CHARS}")
