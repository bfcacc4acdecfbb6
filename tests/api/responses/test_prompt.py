"""Responses prompt rendering (F2, F5) as golden text: items -> template messages -> prompt tokens,
over a tiny template that prints what it is given and a tiny byte-level vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from mlxcel.api.context import SamplingDefaults
from mlxcel.api.errors import ApiError
from mlxcel.api.responses.create import parse_create_request
from mlxcel.api.responses.items import stored_items
from mlxcel.api.responses.prompt import render_conversation, render_prompt
from mlxcel.api.responses.schemas import parse_input_items
from mlxcel.chat.plan import ChatFeatures, FeatureSettings
from mlxcel.text.chat_template import ChatTemplate
from mlxcel.text.tokenizer import Tokenizer
from tests.text.conftest import tiny_byte_level_metadata

# Prints each message, its tool calls, and the tools and kwargs the template receives.
SOURCE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}"
          "{% if m.tool_calls %} calls={{ m.tool_calls | tojson }}{% endif %}"
          "{% if m.reasoning_content %} thought={{ m.reasoning_content }}{% endif %}{{ '\\n' }}{% endfor %}"
          "{% if tools %}tools={{ tools | tojson }}{{ '\\n' }}{% endif %}"
          "{% if flavour %}flavour={{ flavour }}{{ '\\n' }}{% endif %}"
          "{% if add_generation_prompt %}<assistant>{% endif %}")


@dataclass(frozen=True)
class TemplateContext:
    """What render_prompt reads of an ApiContext."""

    chat_template: ChatTemplate | None
    tokenizer: Tokenizer
    features: ChatFeatures  # template kwargs and the rest of the chat features (S-V)
    context_size: int = 4096
    sampling: SamplingDefaults = SamplingDefaults()  # the server's sampling defaults (none set)


@pytest.fixture(scope="module")
def ctx() -> TemplateContext:
    template, tokenizer = ChatTemplate(SOURCE), Tokenizer.from_gguf(tiny_byte_level_metadata())
    features = ChatFeatures.build(tokenizer, template, FeatureSettings(), model_name="tiny", model_type="llama")
    return TemplateContext(template, tokenizer, features)


def conversation(value: Any) -> list[dict[str, Any]]:
    return stored_items(parse_input_items(value))


def test_f2_prompt_golden(ctx: TemplateContext) -> None:
    req = parse_create_request({"input": "x", "instructions": "Be brief.", "chat_template_kwargs": {"flavour": "mint"},
                                "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]})
    items = conversation([
        {"role": "user", "content": "hello"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "use f"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is 42."}]},
        {"role": "user", "content": "world"}])
    prompt = render_prompt(ctx, req, items)  # type: ignore[arg-type]
    assert prompt.text == (
        "<system>Be brief.\n"
        "<user>hello\n"
        "<assistant> calls=[{\"id\": \"c1\", \"type\": \"function\", \"function\": {\"name\": \"f\", "
        "\"arguments\": \"{}\"}}] thought=use f\n"
        "<tool>42\n"
        "<assistant>It is 42.\n"
        "<user>world\n"
        "tools=[{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"type\": \"object\"}}}]\n"
        "flavour=mint\n"
        "<assistant>")
    assert prompt.token_ids == tuple(ctx.tokenizer.encode(prompt.text, add_special_tokens=False))


def test_f2_truncation_auto_drops_whole_turns(ctx: TemplateContext) -> None:
    items = conversation([{"role": "user", "content": "first " * 30}, {"role": "assistant", "content": "ok"},
                          {"role": "user", "content": "second"}])
    small = TemplateContext(ctx.chat_template, ctx.tokenizer, ctx.features, context_size=60)
    auto = parse_create_request({"input": "x", "truncation": "auto"})
    kept = render_conversation(small, auto, items)  # type: ignore[arg-type]
    assert [item["content"][0]["text"] for item in kept.conversation] == ["second"]
    assert len(kept.prompt.token_ids) < 60
    whole = render_conversation(small, parse_create_request({"input": "x"}), items)  # type: ignore[arg-type]
    assert len(whole.conversation) == 3 and len(whole.prompt.token_ids) >= 60  # disabled: the engine says 400


def test_f2_reserved_kwargs_and_missing_template_are_400(ctx: TemplateContext) -> None:
    reserved = parse_create_request({"input": "x", "chat_template_kwargs": {"messages": []}})
    with pytest.raises(ApiError, match="chat_template_kwargs may not set messages"):
        render_prompt(ctx, reserved, conversation("x"))  # type: ignore[arg-type]
    bare = TemplateContext(None, ctx.tokenizer, ctx.features)
    with pytest.raises(ApiError, match="no chat template"):
        render_prompt(bare, parse_create_request({"input": "x"}), conversation("x"))  # type: ignore[arg-type]
