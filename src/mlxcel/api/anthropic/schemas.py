"""Anthropic Messages request bodies (E1): /v1/messages and /v1/messages/count_tokens.

Content blocks are a tagged union on `type` (text, image, tool_use, tool_result, thinking,
redacted_thinking); any other block type is a 400 naming it. Types are strict, unknown fields
(cache_control, citations, service_tier...) are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from mlxcel.api.schema import ChatFeatureFields, WireModel


class TextBlock(WireModel):
    type: Literal["text"]
    text: str


class ImageSource(WireModel):
    """base64 (`media_type` + `data`) or url (`url`)."""

    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None

    @model_validator(mode="after")
    def _check_fields(self) -> ImageSource:
        if self.type == "base64" and (self.data is None or self.media_type is None):
            raise ValueError("source: a base64 image needs media_type and data")
        if self.type == "url" and self.url is None:
            raise ValueError("source: a url image needs url")
        return self


class ImageBlock(WireModel):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(WireModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


ToolResultPart = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(WireModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ToolResultPart] | None = None
    is_error: bool = False


class ThinkingBlock(WireModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(WireModel):
    type: Literal["redacted_thinking"]
    data: str = ""


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(WireModel):
    # "system" in the list: Claude Code 2.1.3xx sends its environment that way (and retries without on a 400)
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @model_validator(mode="after")
    def _system_is_text(self) -> Message:
        if self.role == "system" and not isinstance(self.content, str):
            for i, block in enumerate(self.content):
                if not isinstance(block, TextBlock):
                    raise ValueError(f"content.{i}.type: a system message holds text blocks only, not {block.type!r}")
        return self


class Tool(WireModel):
    """A client tool; the template sees it as an OpenAI-style function."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    type: str | None = None  # "custom" or absent; server tools (web_search_...) are refused


class ToolChoice(WireModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(WireModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)


class OutputConfig(WireModel):
    format: Any = None  # checked by the grammar (V)


class Metadata(WireModel):
    user_id: str | None = None


class ConversationFields(ChatFeatureFields):
    """What shapes the prompt: shared by /v1/messages and /v1/messages/count_tokens (with the
    chat-feature extensions of ChatFeatureFields: template kwargs, loop guard, json_schema...)."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_format: Any = None  # a JSON schema format (V), beta spelling; checked by the grammar
    output_config: OutputConfig | None = None  # V: output_config.format

    @property
    def shows_thinking(self) -> bool:
        """Whether the reply carries thinking blocks: only when the request enables thinking."""
        return self.thinking is not None and self.thinking.type != "disabled"

    @model_validator(mode="after")
    def _check_tools(self) -> ConversationFields:
        for i, tool in enumerate(self.tools or ()):
            if tool.type not in (None, "custom"):
                raise ValueError(f"tools.{i}: the server tool {tool.type!r} is not available here; "
                                 "only client tools (name, description, input_schema) are")
        return self


class MessagesRequest(ConversationFields):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None


class CountTokensRequest(ConversationFields):
    pass
