"""Chat templates (A6 template part, S): HF rendering semantics, errors as TemplateError, loading."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from mlxcel.text.chat_template import BUILTIN_TEMPLATES, ChatTemplate, TemplateError, load_chat_template

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "2+2? Answer with émoji 🤗\n\n  please"},
    ],
]


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_a6_smollm2_template_renders_like_transformers(
    smollm2_metadata: dict[str, Any], smollm2_reference: Any, conversation: int, add_generation_prompt: bool
) -> None:
    """The real SmolLM2 template: default system prompt, generation prompt, multi-turn."""
    template = load_chat_template(gguf_metadata=smollm2_metadata)
    assert template is not None
    messages = CONVERSATIONS[conversation]
    expected = smollm2_reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected
    assert template.bos_token == "<|im_start|>" and template.eos_token == "<|im_end|>"


@pytest.mark.slow
def test_a6_smollm2_system_default_and_generation_suffix(smollm2_metadata: dict[str, Any]) -> None:
    template = load_chat_template(gguf_metadata=smollm2_metadata)
    assert template is not None
    text = template.render([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert template.generation_prompt_suffix() == "<|im_start|>assistant\n"
    assert not template.mentions("enable_thinking")


@pytest.mark.slow
def test_a6_gemma3_base_has_no_template(gemma3_metadata: dict[str, Any]) -> None:
    assert load_chat_template(gguf_metadata=gemma3_metadata) is None


def test_s_template_error_is_template_error_not_concatenation() -> None:
    template = ChatTemplate("{{ messages[0].content + 1 }}")
    with pytest.raises(TemplateError, match="chat template error: TypeError"):
        template.render([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError, match="syntax error at line 1"):
        ChatTemplate("{% for m in messages %}")


def test_s_raise_exception_message_reaches_the_caller() -> None:
    source = (
        "{% for m in messages %}{% if m.role == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}{{ m.content }}{% endfor %}"
    )
    template = ChatTemplate(source)
    assert template.render([{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(TemplateError) as info:
        template.render([{"role": "system", "content": "x"}])
    assert str(info.value) == "System role not supported"


def test_a6_tojson_keeps_unicode_and_supports_indent() -> None:
    template = ChatTemplate("{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}|{{ '<a&b>' | tojson }}")
    tools = [{"name": "météo", "n": 1}]
    compact, indented, html = template.render([], tools=tools).split("|")
    assert compact == '[{"name": "météo", "n": 1}]'
    assert indented == json.dumps(tools[0], indent=2, ensure_ascii=False)
    assert html == '"<a&b>"'  # no HTML escaping


def test_a6_environment_features() -> None:
    source = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
        "{{ bos_token }}{{ eos_token }}{{ pad_token }}|{{ strftime_now('%Y') }}|{{ custom }}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>", special_tokens={"pad_token": "<pad>"})
    messages = [{"role": "skip", "content": "a"}, {"role": "user", "content": "b"}, {"role": "user", "content": "c"}]
    text = template.render(messages, custom="kw")
    assert text == f"[b]<s></s><pad>|{datetime.now().year}|kw>"
    assert template.render(messages, add_generation_prompt=False, custom="kw").endswith("kw")


def test_a6_trim_and_lstrip_blocks() -> None:
    source = "{% for m in messages %}\n    {{ m.content }}\n{% endfor %}\n"
    assert ChatTemplate(source).render([{"role": "user", "content": "a"}]) == "    a\n"
    source = "  {% if true %}\nx\n  {% endif %}\n"
    assert ChatTemplate(source).render([]) == "x\n"


def test_a6_sandbox_refuses_mutation_and_private_names() -> None:
    with pytest.raises(TemplateError, match="chat template error"):
        ChatTemplate("{{ messages.append(1) }}").render([])
    with pytest.raises(TemplateError, match="not allowed"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([])
    assert ChatTemplate("{{ ''.__class__ }}").render([]) == ""


def test_a6_none_values_are_dropped_and_reasoning_aliased() -> None:
    source = (
        "{% for m in messages %}{{ m.role }}:{{ m.content if m.content is defined else '-' }}"
        "/{{ m.reasoning_content | default('') }}/{{ m.thinking | default('') }};{% endfor %}"
    )
    messages = [{"role": "assistant", "content": None, "reasoning": "why"}]
    assert ChatTemplate(source).render(messages) == "assistant:-/why/why;"
    assert messages == [{"role": "assistant", "content": None, "reasoning": "why"}]  # caller's copy intact


def test_a6_continue_final_message_leaves_the_turn_open() -> None:
    template = ChatTemplate(BUILTIN_TEMPLATES["chatml"])
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, "}]
    text = template.render(messages, continue_final_message=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nSure, "
    with pytest.raises(TemplateError, match="cannot be continued"):
        ChatTemplate("{{ 'fixed' }}").render(messages, continue_final_message=True)


def test_s_mentions_and_thinking_generation_prompt() -> None:
    source = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
        "{% else %}<think>\n{% endif %}{% endif %}"
    )
    template = ChatTemplate(source)
    assert template.mentions("enable_thinking")
    assert not template.mentions("reasoning_effort")
    assert template.generation_prompt_suffix() == "<|assistant|><think>\n"
    assert template.generation_prompt_suffix(enable_thinking=False) == "<|assistant|><think>\n\n</think>\n\n"


def test_a6_tool_use_variant_is_used_when_tools_are_given(tmp_path: Path) -> None:
    config = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>"},
        "chat_template": [
            {"name": "default", "template": "plain{{ bos_token }}"},
            {"name": "tool_use", "template": "tools:{{ tools | length }}{{ eos_token }}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = load_chat_template(model_dir=tmp_path)
    assert template is not None
    assert template.render([]) == "plain<s>"
    assert template.render([], tools=[{"type": "function"}]) == "tools:1</s>"
    assert template.mentions("tools")


def test_a6_load_order(tmp_path: Path) -> None:
    gguf = {"tokenizer.chat_template": "gguf", "tokenizer.ggml.tokens": ["<b>", "<e>"],
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1}  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config"}))
    assert _rendered(gguf_metadata=gguf) == "gguf"
    assert _rendered(gguf_metadata=gguf, model_dir=tmp_path) == "config"
    (tmp_path / "chat_template.jinja").write_text("jinja file")
    assert _rendered(gguf_metadata=gguf, model_dir=tmp_path) == "jinja file"
    override = tmp_path / "override.jinja"
    override.write_text("{{ bos_token }}override{{ eos_token }}")
    assert _rendered(override_file=override, model_dir=tmp_path, gguf_metadata=gguf) == "<b>override<e>"
    assert _rendered(override_source="{{ 'inline' }}", override_file=override) == "inline"
    assert load_chat_template(model_dir=tmp_path / "nothing") is None
    assert load_chat_template() is None


def test_a6_builtin_names_and_bad_overrides(tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}]
    chatml = load_chat_template(override_source="chatml")
    assert chatml is not None
    assert chatml.render(messages) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    gemma = load_chat_template(override_source="gemma", bos_token="<bos>")
    assert gemma is not None
    assert gemma.render(messages) == "<bos><start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\n"
    llama3 = load_chat_template(override_source="llama3", bos_token="<|begin_of_text|>")
    assert llama3 is not None
    assert llama3.render(messages[1:]) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    with pytest.raises(TemplateError, match=re.escape("built-in template name (chatml, gemma, llama3)")):
        load_chat_template(override_source="vicuna")
    with pytest.raises(TemplateError, match="--chat-template-file .*cannot be read"):
        load_chat_template(override_file=tmp_path / "missing.jinja")


def _rendered(**sources: Any) -> str:
    template = load_chat_template(**sources)
    assert template is not None
    return template.render([])
