"""Chat-template kwargs (S): merge order, startup errors, thinking default, reasoning_effort,
and preserve_thinking's stripping of old `<think>` blocks, rendered by a real template."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from mlxcel.text.chat_template import ChatTemplate
from mlxcel.chat.reasoning import ThinkTokens
from mlxcel.api.errors import ApiError
from mlxcel.chat.template_kwargs import (
    TemplateKwargsError, Template, preserves_thinking, server_template_kwargs, strip_stale_thinking,
    with_thinking_default,
)  # fmt: skip
from mlxcel.chat.template_kwargs import effective_template_kwargs as effective_from_options
from tests.chat.wire import chat_options

def request_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The request's kwargs as its adapter reads them (api/chat_options.py)."""
    return dict(chat_options(body).template_kwargs)


def effective_template_kwargs(defaults: dict[str, Any], body: dict[str, Any], template: Template | None
                              ) -> dict[str, Any]:
    options = chat_options(body)
    return effective_from_options(defaults, options.template_kwargs, options.reasoning_effort, template)


THINK = ThinkTokens("<think>", "</think>", (1,), (2,))
EFFORT_TEMPLATE = ChatTemplate(
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if reasoning_effort is defined %}effort={{ reasoning_effort }}{% endif %}"
)
PLAIN_TEMPLATE = ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")


def test_s_server_defaults_cli_over_env_per_key() -> None:
    merged = server_template_kwargs('{"preserve_thinking": true}', '{"preserve_thinking": false, "x": 1}')
    assert merged == {"preserve_thinking": True, "x": 1}
    assert server_template_kwargs(None, None) == {}


@pytest.mark.parametrize(("cli", "env", "message"), [
    ("{preserve_thinking: true}", None, "--chat-template-kwargs is not valid JSON"),
    (None, "[1, 2]", "LLAMA_ARG_CHAT_TEMPLATE_KWARGS must be a JSON object, not list"),
    ('{"tools": []}', None, "may not set tools"),
])  # fmt: skip
def test_s_invalid_server_kwargs_refuse_startup(cli: str | None, env: str | None, message: str) -> None:
    with pytest.raises(TemplateKwargsError, match=message):
        server_template_kwargs(cli, env)


def test_s_request_layers_merge_per_key_in_order() -> None:
    body = {
        "preserve_thinking": True,  # DashScope flat form as the OpenAI SDK sends extra_body
        "extra_body": {"preserve_thinking": False, "chat_template_kwargs": {"a": "extra", "b": "extra"}},
        "chat_template_kwargs": {"a": "root"},
    }
    assert request_template_kwargs(body) == {"preserve_thinking": False, "a": "root", "b": "extra"}
    body = {"extra_body": {"preserve_thinking": True}, "chat_template_kwargs": {"preserve_thinking": False}}
    assert request_template_kwargs(body)["preserve_thinking"] is False


def test_s_request_keys_override_server_defaults_and_keep_the_rest() -> None:
    """The spec's example: server {preserve: true, enable: false} + request {preserve: false}."""
    server = {"preserve_thinking": True, "enable_thinking": False}
    kwargs = effective_template_kwargs(server, {"chat_template_kwargs": {"preserve_thinking": False}}, None)
    assert kwargs == {"preserve_thinking": False, "enable_thinking": False}


@pytest.mark.parametrize(("body", "message"), [
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs must be a JSON object"),
    ({"preserve_thinking": "yes"}, "preserve_thinking must be true or false"),
    ({"chat_template_kwargs": {"messages": []}}, "may not set messages"),
])  # fmt: skip
def test_s_invalid_request_kwargs_are_400s(body: dict[str, Any], message: str) -> None:
    with pytest.raises(TemplateKwargsError, match=message):
        request_template_kwargs(body)


def test_s_invalid_nested_kwargs_are_400s() -> None:
    """The extra_body rule (api/schema.flatten_extra_body) refuses a nested non-object at once."""
    with pytest.raises(ApiError, match="extra_body.chat_template_kwargs must be a JSON object") as caught:
        request_template_kwargs({"extra_body": {"chat_template_kwargs": [1]}})
    assert caught.value.status == 400


def test_s_enable_thinking_default_with_markers_logged(caplog: pytest.LogCaptureFixture) -> None:
    gemma4 = ThinkTokens("<|channel>thought", "<channel|>", (10, 11), (12,))
    with caplog.at_level(logging.INFO, logger="mlxcel.chat.template_kwargs"):
        assert with_thinking_default({"x": 1}, gemma4) == {"x": 1, "enable_thinking": True}
    assert ('defaulting chat_template kwarg `enable_thinking=true` think_start=Some("<|channel>thought") '
            'think_end=Some("<channel|>") think_start_tokens_len=2 think_end_tokens_len=1') in caplog.text
    assert with_thinking_default({"enable_thinking": False}, gemma4) == {"enable_thinking": False}
    assert with_thinking_default({}, None) == {}


def test_s_request_can_turn_the_thinking_default_off() -> None:
    defaults = with_thinking_default({}, THINK)
    kwargs = effective_template_kwargs(defaults, {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
                                       None)
    assert kwargs["enable_thinking"] is False


def test_s_reasoning_effort_maps_only_when_the_template_reads_it() -> None:
    body = {"reasoning_effort": "high", "messages": [{"role": "user", "content": "hi"}]}
    kwargs = effective_template_kwargs({}, body, EFFORT_TEMPLATE)
    assert kwargs == {"reasoning_effort": "high"}
    assert EFFORT_TEMPLATE.render(body["messages"], add_generation_prompt=False, **kwargs).endswith("effort=high")
    assert effective_template_kwargs({}, body, PLAIN_TEMPLATE) == {}
    explicit = {**body, "chat_template_kwargs": {"reasoning_effort": "low"}}
    assert effective_template_kwargs({}, explicit, EFFORT_TEMPLATE)["reasoning_effort"] == "low"


def test_s_preserve_thinking_false_strips_blocks_before_the_last_user_turn() -> None:
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>old</think>\n\na1", "reasoning_content": "kept for the template"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>recent</think>a2", "tool_calls": [{"id": "c"}]},
        {"role": "user", "content": "<tool_response>42</tool_response>"},  # a tool result: not a query
    ]
    stripped = strip_stale_thinking(messages, THINK)
    assert stripped[1]["content"] == "a1"
    assert stripped[1]["reasoning_content"] == "kept for the template"
    assert stripped[3]["content"] == "<think>recent</think>a2"  # after the last real user turn
    assert messages[1]["content"].startswith("<think>")  # the input is not changed
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "<think>x</think>y"}]},
             {"role": "user", "content": "q"}]
    assert strip_stale_thinking(parts, THINK)[0]["content"] == [{"type": "text", "text": "y"}]


def test_s_preserve_thinking_defaults_to_false() -> None:
    assert not preserves_thinking({})
    assert not preserves_thinking({"preserve_thinking": False})
    assert preserves_thinking({"preserve_thinking": True})
