"""Chat templates rendered with Hugging Face semantics, and where a model's template comes from.

Rendering follows transformers' `apply_chat_template`: a sandboxed jinja2 environment with
trim_blocks/lstrip_blocks, the loopcontrols extension and a no-op `{% generation %}` tag,
`raise_exception`, a `tojson` that keeps non-ASCII text and accepts `indent`, `strftime_now`,
and the variables messages/tools/documents/add_generation_prompt/bos_token/eos_token plus any
extra keyword (chat_template_kwargs, spec S). A template that cannot render raises
`TemplateError`, which the server answers with 400; there is never a fallback concatenation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlxcel.text.template_polyfill import TemplateCaps, polyfill_messages

# Older names for a message's reasoning; templates read `reasoning_content` (gpt-oss: `thinking`).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Marks where the final message ends, so continue_final_message can cut the render there.
_CONTINUE_TAG = "\x00MLXCEL_CONTINUE\x00"
_PROBE_MESSAGES: tuple[dict[str, str], ...] = ({"role": "user", "content": "Hi"},)


class TemplateError(ValueError):
    """A chat template failed to compile, load or render; the message is fit for a 400 reply."""


class ChatTemplate:
    """One compiled chat template and the special-token strings it may reference."""

    def __init__(
        self,
        source: str,
        *,
        bos_token: str = "",
        eos_token: str = "",
        special_tokens: Mapping[str, str] | None = None,
        tool_use_source: str | None = None,
        name: str | None = None,
    ) -> None:
        self.source = source
        self.name = name
        self.special_tokens = {**(special_tokens or {}), "bos_token": bos_token, "eos_token": eos_token}
        self.tool_use_source = tool_use_source
        self._template = _compile(source)
        # transformers picks a model's "tool_use" template when the request carries tools.
        self._tool_use = _compile(tool_use_source) if tool_use_source else None

    @property
    def bos_token(self) -> str:
        return self.special_tokens["bos_token"]

    @property
    def eos_token(self) -> str:
        return self.special_tokens["eos_token"]

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages`; extra keywords become template variables.

        With `continue_final_message` the last message is left open for the model to continue
        (an assistant prefill) and no generation prompt is added. Raises TemplateError.
        """
        chat = normalize_messages(messages)
        if not self.caps.is_complete or self.caps.needs_string_content:
            chat = polyfill_messages(self.caps, chat, _plain(list(tools)) if tools else None)
        if continue_final_message:
            _tag_final_message(chat)
            add_generation_prompt = False
        text = self._render_plain(chat, add_generation_prompt=add_generation_prompt, tools=tools,
                                  documents=documents, **kwargs)
        return _cut_at_tag(text) if continue_final_message else text

    def _render_plain(self, chat: list[dict[str, Any]], *, add_generation_prompt: bool,
                      tools: Sequence[Mapping[str, Any]] | None = None,
                      documents: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        template = self._tool_use if tools and self._tool_use is not None else self._template
        variables = {
            **self.special_tokens,
            **_plain(kwargs),
            "messages": chat,
            "tools": _plain(list(tools)) if tools is not None else None,
            "documents": _plain(list(documents)) if documents is not None else None,
            "add_generation_prompt": add_generation_prompt,
        }
        return _render(template, variables)

    @cached_property
    def caps(self) -> TemplateCaps:
        """Which tool turns the template renders itself; the rest are rewritten as text."""
        return TemplateCaps.probe(self._render_plain)

    def mentions(self, name: str) -> bool:
        """Whether the template reads the variable `name` (e.g. "enable_thinking", "reasoning_effort")."""
        return name in self._variable_names

    def generation_prompt_suffix(
        self, messages: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any
    ) -> str:
        """What add_generation_prompt=True adds after the conversation, e.g. "<|im_start|>assistant\\n"
        or "...<think>\\n"; "" when the two renders do not share a prefix or fail."""
        chat = list(messages) if messages is not None else [dict(m) for m in _PROBE_MESSAGES]
        try:
            closed = self.render(chat, add_generation_prompt=False, **kwargs)
            opened = self.render(chat, add_generation_prompt=True, **kwargs)
        except TemplateError:
            return ""
        return opened[len(closed) :] if opened.startswith(closed) else ""

    @cached_property
    def _variable_names(self) -> frozenset[str]:
        names: set[str] = set()
        for source in (self.source, self.tool_use_source or ""):
            names.update(node.name for node in _ENV.parse(source).find_all(jinja2.nodes.Name))
        return frozenset(names)


# --- the environment ------------------------------------------------------------------------


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class SafeNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes, so a template cannot reach internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_attribute(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_attribute(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_attribute(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def raise_exception(message: str) -> None:
    """The template's own error (e.g. "roles must alternate"); it reaches the client as a 400."""
    raise TemplateError(str(message))


def tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON without jinja's HTML escaping and with non-ASCII text kept, as transformers renders it."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = SafeNamespace
    return env


_ENV = _environment()  # stateless after construction; compiled templates share it


def _compile(source: str) -> jinja2.Template:
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template syntax error at line {exc.lineno}: {exc.message}") from exc


def _render(template: jinja2.Template, variables: Mapping[str, Any]) -> str:
    try:
        return template.render(**variables)
    except TemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise TemplateError(f"chat template error: {exc.message or type(exc).__name__}") from exc
    except Exception as exc:  # noqa: BLE001 - a template can raise anything Python can
        raise TemplateError(f"chat template error: {type(exc).__name__}: {exc}") from exc


# --- messages -------------------------------------------------------------------------------


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain dict copies: keys whose value is None dropped (templates print "None" or crash on
    them), and reasoning copied under every name templates read."""
    chat = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TemplateError(f"each message must be an object, not {type(message).__name__}")
        plain = {k: v for k, v in _plain(dict(message)).items() if v is not None}
        reasoning = next((plain[k] for k in REASONING_FIELDS if k in plain), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        chat.append(plain)
    return chat


def _plain(value: Any) -> Any:
    # Only JSON-like data enters the sandbox; anything richer becomes an inert "<TypeName>".
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    for base in (bool, str, int, float):
        if isinstance(value, base):
            return base(value)
    return f"<{type(value).__name__}>"


def _tag_final_message(chat: list[dict[str, Any]]) -> None:
    if not chat:
        raise TemplateError("continue_final_message needs at least one message")
    final = chat[-1]
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_TAG
        return
    if isinstance(content, list):
        for part in reversed(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                part["text"] = part["text"] + _CONTINUE_TAG
                return
    raise TemplateError("the final message has no text content to continue")


def _cut_at_tag(text: str) -> str:
    at = text.rfind(_CONTINUE_TAG)
    if at < 0:
        raise TemplateError("the chat template drops the final message, so it cannot be continued")
    return text[:at]


# --- where a template comes from (A6) ------------------------------------------------------

# Text content of a message whether it is a string or a list of {"type": "text"} parts.
_CONTENT_MACRO = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is iterable -%}"
    "{%- for part in content if part.type == 'text' -%}{{ part.text }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
)
BUILTIN_TEMPLATES: Mapping[str, str] = {
    "chatml": _CONTENT_MACRO
    + "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message.role + '\n' + text(message.content) + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}",
    "llama3": _CONTENT_MACRO
    + "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{{ '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' }}"
    "{{ text(message.content) | trim }}{{ '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif -%}",
    # Gemma has no system role: the system text opens the first user turn.
    "gemma": _CONTENT_MACRO
    + "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}{%- set ns.system = text(message.content) + '\n\n' -%}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + ('model' if message.role == 'assistant' else message.role) + '\n' }}"
    "{{ ns.system }}{%- set ns.system = '' -%}"
    "{{ text(message.content) | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}",
}


def load_chat_template(
    *,
    override_source: str | None = None,
    override_file: Path | None = None,
    gguf_metadata: Mapping[str, Any] | None = None,
    model_dir: Path | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
) -> ChatTemplate | None:
    """The chat template to serve with, or None when the model has none.

    Order: `--chat-template` (a built-in name such as "chatml", or Jinja text), then
    `--chat-template-file`, then the model folder (chat_template.jinja, chat_template.json,
    tokenizer_config.json `chat_template`, a string or a list of named templates), then the
    GGUF `tokenizer.chat_template`. bos/eos default to the model's own special tokens.
    """
    config = _read_json_object(model_dir / "tokenizer_config.json") if model_dir else {}
    tokens = _special_token_strings(config, gguf_metadata or {})
    if bos_token is not None:
        tokens["bos_token"] = bos_token
    if eos_token is not None:
        tokens["eos_token"] = eos_token
    found = _find_source(override_source, override_file, gguf_metadata or {}, model_dir, config)
    if found is None:
        return None
    source, tool_use, name = found
    return ChatTemplate(
        source,
        bos_token=tokens.pop("bos_token", ""),
        eos_token=tokens.pop("eos_token", ""),
        special_tokens=tokens,
        tool_use_source=tool_use,
        name=name,
    )


def _find_source(
    override_source: str | None,
    override_file: Path | None,
    metadata: Mapping[str, Any],
    model_dir: Path | None,
    config: Mapping[str, Any],
) -> tuple[str, str | None, str] | None:
    if override_source:
        return _from_override(override_source)
    if override_file is not None:
        return _read_text(Path(override_file), "--chat-template-file"), None, str(override_file)
    if model_dir is not None:
        found = _from_model_dir(Path(model_dir), config)
        if found is not None:
            return found
    return _from_gguf(metadata)


def _from_override(value: str) -> tuple[str, None, str]:
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value], None, value
    if "{{" in value or "{%" in value:
        return value, None, "--chat-template"
    raise TemplateError(
        f"--chat-template {value!r} is neither a built-in template name "
        f"({', '.join(sorted(BUILTIN_TEMPLATES))}) nor Jinja text; use --chat-template-file for a file"
    )


def _from_model_dir(folder: Path, config: Mapping[str, Any]) -> tuple[str, str | None, str] | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return _read_text(jinja_file, "chat template"), None, str(jinja_file)
    json_file = folder / "chat_template.json"
    if json_file.is_file():
        found = _from_config_value(_read_json_object(json_file).get("chat_template"), str(json_file))
        if found is not None:
            return found
    return _from_config_value(config.get("chat_template"), str(folder / "tokenizer_config.json"))


def _from_config_value(value: Any, origin: str) -> tuple[str, str | None, str] | None:
    """tokenizer_config.json's chat_template: a string, or [{"name": ..., "template": ...}, ...]."""
    if isinstance(value, str) and value:
        return value, None, origin
    if isinstance(value, list):
        named = {
            item["name"]: item["template"]
            for item in value
            if isinstance(item, dict) and isinstance(item.get("template"), str) and "name" in item
        }
        default = named.get("default") or next(iter(named.values()), None)
        if default:
            return default, named.get("tool_use"), origin
    return None


def _from_gguf(metadata: Mapping[str, Any]) -> tuple[str, str | None, str] | None:
    source = metadata.get("tokenizer.chat_template")
    if not isinstance(source, str) or not source:
        return None
    tool_use = metadata.get("tokenizer.chat_template.tool_use")
    tool_use = tool_use if isinstance(tool_use, str) and tool_use else None
    return source, tool_use, "GGUF tokenizer.chat_template"


def _special_token_strings(config: Mapping[str, Any], metadata: Mapping[str, Any]) -> dict[str, str]:
    names = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
    tokens: Sequence[str] = metadata.get("tokenizer.ggml.tokens") or ()
    found: dict[str, str] = {}
    for name, gguf_key in names.items():
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        token_id = metadata.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if not isinstance(value, str) and isinstance(token_id, int) and 0 <= token_id < len(tokens):
            value = tokens[token_id]
        if isinstance(value, str):
            found[name] = value
    return found


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TemplateError(f"{what} {path}: cannot be read ({exc.strerror or exc})") from exc


def _read_json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(_read_text(path, "file"))
    except ValueError as exc:
        raise TemplateError(f"{path}: not valid JSON ({exc})") from exc
    return value if isinstance(value, dict) else {}
