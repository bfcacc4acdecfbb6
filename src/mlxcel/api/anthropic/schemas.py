"""Anthropic Messages request bodies (E1): /v1/messages and /v1/messages/count_tokens.

Content blocks are a tagged union on `type`: text, image, tool_use, tool_result, thinking,
redacted_thinking, and the blocks Anthropic documents that a text model reads as text (issue 46):
`tool_reference` (Claude Code's tool search, inside a tool_result), `search_result`, `document`, and
as history `server_tool_use` / `web_search_tool_result`. Any other block type is an `OtherBlock`
(rendered as its `text` where it has one, logged once: never a 400). Types are strict, unknown fields
(cache_control, citations, service_tier...) are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator

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


class ToolReferenceBlock(WireModel):
    """A tool the tool search found (Claude Code's ToolSearch): its definition is in `tools`."""

    type: Literal["tool_reference"]
    tool_name: str


class SearchResultBlock(WireModel):
    type: Literal["search_result"]
    source: str = ""
    title: str = ""
    content: list[TextBlock] = Field(default_factory=list)


class DocumentSource(WireModel):
    """text (`data`), content (text blocks), base64 (a PDF's bytes), url or file: only text is readable here."""

    type: str
    media_type: str | None = None
    data: str | None = None
    url: str | None = None
    file_id: str | None = None
    content: str | list[dict[str, Any]] | None = None


class DocumentBlock(WireModel):
    type: Literal["document"]
    source: DocumentSource
    title: str | None = None
    context: str | None = None


class ServerToolUseBlock(WireModel):
    """A server tool's call (web_search...) in an assistant turn of the history."""

    type: Literal["server_tool_use"]
    id: str = ""
    name: str = ""
    input: dict[str, Any] = Field(default_factory=dict)


class WebSearchToolResultBlock(WireModel):
    """A web search's results in the history: a list of results, or an error object."""

    type: Literal["web_search_tool_result"]
    tool_use_id: str = ""
    content: list[dict[str, Any]] | dict[str, Any] = Field(default_factory=list)


class OtherBlock(WireModel):
    """A block type this server does not know: its `text`, where it has one, is what the prompt shows."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)

    type: str
    text: str | None = None


def _block_tag(known: frozenset[str]) -> Any:
    """A discriminator that sends every type outside `known` to OtherBlock instead of a 400."""
    def tag(value: Any) -> str:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return kind if kind in known else "other"
    return Discriminator(tag)


def _union(*models: type[WireModel]) -> Any:
    """A tagged union of `models` (by their `type` literal) with OtherBlock for any other type."""
    names = [model.model_fields["type"].annotation.__args__[0] for model in models]
    members = tuple(Annotated[model, Tag(name)] for model, name in zip(models, names))
    return Annotated[Union[*members, Annotated[OtherBlock, Tag("other")]], _block_tag(frozenset(names))]


ToolResultPart = _union(TextBlock, ImageBlock, ToolReferenceBlock, SearchResultBlock, DocumentBlock)


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


ContentBlock = _union(TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock,
                      ToolReferenceBlock, SearchResultBlock, DocumentBlock, ServerToolUseBlock,
                      WebSearchToolResultBlock)


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
