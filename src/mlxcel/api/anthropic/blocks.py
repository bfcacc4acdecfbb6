"""The text a chat template sees for Anthropic blocks that have no chat-message field of their own (issue 46).

Chat templates know text, tool calls and tool results; Anthropic's other documented blocks arrive as
history (Claude Code's tool search puts `tool_reference` blocks in a tool_result) and are read as text:

    tool_reference           -> "Tool loaded: <tool_name>" (its definition is among the request's tools)
    search_result            -> its title, source and text
    document                 -> its title, context and text (a text or content source; a PDF or URL
                                source cannot be read by a text model: its title and "[document]")
    server_tool_use          -> "<name>: <input JSON>" (a web search the server ran for the client)
    web_search_tool_result   -> one line per result (title, url) or its error code
    any other type           -> its `text` where it has one; logged once per type, never a 400
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from typing import Any

from mlxcel.api.anthropic.schemas import (
    DocumentBlock, OtherBlock, SearchResultBlock, ServerToolUseBlock, TextBlock, ToolReferenceBlock,
    WebSearchToolResultBlock,
)  # fmt: skip

log = logging.getLogger(__name__)


def block_text(block: Any) -> str | None:
    """The text a block shows in the prompt; None for blocks shown elsewhere or with nothing to show."""
    if isinstance(block, TextBlock):
        return block.text
    if isinstance(block, ToolReferenceBlock):
        return f"Tool loaded: {block.tool_name}"
    if isinstance(block, SearchResultBlock):
        return _joined([block.title, block.source, *(part.text for part in block.content)])
    if isinstance(block, DocumentBlock):
        return _joined([block.title, block.context, _document_text(block)])
    if isinstance(block, ServerToolUseBlock):
        return f"{block.name}: {json.dumps(block.input, ensure_ascii=False)}"
    if isinstance(block, WebSearchToolResultBlock):
        return _web_search_text(block.content)
    if isinstance(block, OtherBlock):
        note_unknown_block(block.type)
        return block.text
    return None


def blocks_text(blocks: Sequence[Any]) -> str:
    """The texts of `blocks` that have one, a line break between them."""
    return "\n".join(text for text in map(block_text, blocks) if text)


@functools.cache
def note_unknown_block(kind: str) -> None:
    """Log a block type this server does not know, once per type for the process's life."""
    log.warning("anthropic: content blocks of type %r are not known here; their text (if any) goes into the "
                "prompt", kind[:100])


def _document_text(block: DocumentBlock) -> str:
    source = block.source
    if source.type == "text" and source.data is not None:
        return source.data
    if source.type == "content":
        if isinstance(source.content, str):
            return source.content
        return "\n".join(part["text"] for part in source.content or () if isinstance(part.get("text"), str))
    return f"[document: {source.media_type or source.type}, not readable as text here]"


def _web_search_text(content: list[dict[str, Any]] | dict[str, Any]) -> str:
    if isinstance(content, dict):
        return f"web search error: {content.get('error_code', 'unknown')}"
    return "\n".join(_joined([result.get("title"), result.get("url")], sep=" - ") for result in content)


def _joined(parts: Sequence[Any], sep: str = "\n") -> str:
    return sep.join(part for part in parts if isinstance(part, str) and part)


__all__ = ["block_text", "blocks_text", "note_unknown_block"]
