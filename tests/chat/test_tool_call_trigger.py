"""Issue 26 point 1 (V): under `tool_choice: auto` a tool call names only a declared tool.

The call grammar waits for the format's opener (chat/lazy_grammar.py). A steered "model" on the
real SmolLM2 vocabulary writes free text, the opener (split over several tokens, or sharing a
token with the text around it), then a call to a tool nobody declared; the constrained reply must
keep the free text as written and turn the call into one of the declared tools, with arguments
that fit its schema.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
import torch

from mlxcel.api.chat_options import read_tool_choice
from mlxcel.chat.grammar import GrammarCompiler, declared_tool_names
from mlxcel.chat.lazy_grammar import LazyGrammarProcessor, make_lazy_processor
from mlxcel.chat.tools import make_tool_parser
from mlxcel.chat.tools.base import collect_tool_calls
from mlxcel.chat.events import ContentDelta
from mlxcel.text.tokenizer import Tokenizer
from mlxcel.types import FinishReason
from tests.chat.drive import drive, single_thread  # noqa: F401 - autouse fixture
from tests.chat.test_grammar import SCHEMAS, TOOLS

pytestmark = pytest.mark.slow  # reads the SmolLM2 GGUF vocabulary

UNDECLARED_CALL = '{"name": "get_sunny_city", "ARGS": {"city": "Oslo"}}'
# format -> (the scripted reply, the content before the call)
SCRIPTS = {
    # `.<` is one SmolLM2 token: the opener shares a token with the text before it.
    "hermes": ("Sure.<tool_call>\n" + UNDECLARED_CALL.replace("ARGS", "arguments") + "\n</tool_call>", "Sure."),
    # `][` is one token: the opener shares a token with the call after it.
    "mistral": ("Sure. [TOOL_CALLS][" + UNDECLARED_CALL.replace("ARGS", "arguments") + "]", "Sure."),
    "llama3": ("<|python_tag|>" + UNDECLARED_CALL.replace("ARGS", "parameters"), ""),
    # ` [{` is one token.
    "generic": ('```json\n{"tool_calls": [' + UNDECLARED_CALL.replace("ARGS", "arguments") + "]}\n```", ""),
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_metadata: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_metadata)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer)


def scripted(tokenizer: Tokenizer, script: str) -> Callable[[torch.Tensor, list[int]], None]:
    """A 'model' that writes `script` while it can; once pushed off it, it likes to close JSON
    and then to end the reply."""
    target = tokenizer.encode(script, add_special_tokens=False)
    closers = [i for i in range(tokenizer.vocab_size) if any(c in tokenizer.decode([i]) for c in '"}]')]
    eos = sorted(tokenizer.eos_token_ids)

    def steer(logits: torch.Tensor, output: list[int]) -> None:
        step = len(output)
        if output == target[:step]:
            logits[target[step] if step < len(target) else eos] += 1e4
            return
        logits[closers] += 4.0
        logits[eos] += 40.0  # where the grammar allows it: beats any random logit
    return steer


def generate(
    compiler: GrammarCompiler, fmt: str, seed: int, *, parallel: bool = True, constrained: bool = True
) -> tuple[str, FinishReason]:
    tokenizer = compiler.tokenizer
    lazy = compiler.triggered_tool_calls(fmt, TOOLS, read_tool_choice("auto"), parallel=parallel)
    assert lazy is not None
    processors = [make_lazy_processor(compiler, lazy)] if constrained else []
    tokens, reason = drive(processors, tokenizer.vocab_size, seed=seed, eos_token_ids=tokenizer.eos_token_ids,
                           steer=scripted(tokenizer, SCRIPTS[fmt][0]), max_steps=150)
    return tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids]), reason


def parse(fmt: str, text: str) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    parser = make_tool_parser(fmt, declared=declared_tool_names(TOOLS))
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return content, [(c.name, json.loads(c.arguments)) for c in collect_tool_calls(events)]


@pytest.mark.parametrize("fmt", list(SCRIPTS))
def test_issue26_v_auto_tool_call_after_the_opener_names_a_declared_tool(compiler: GrammarCompiler, fmt: str) -> None:
    script, content_before = SCRIPTS[fmt]
    for seed in range(3):
        free, _ = generate(compiler, fmt, seed, constrained=False)
        assert free == script  # the steering alone writes the undeclared call
        assert parse(fmt, free) == (free, [])  # ... which the parser keeps as text
        text, reason = generate(compiler, fmt, seed)
        assert reason is FinishReason.STOP, text
        content, calls = parse(fmt, text)
        assert content.strip() == content_before, text  # the text before the opener was left free
        assert calls, text  # one call, or several where the format's block holds many (parallel)
        for name, arguments in calls:
            jsonschema.validate(arguments, SCHEMAS[name])


def test_issue26_v_one_call_ends_the_reply_without_parallel_calls(compiler: GrammarCompiler) -> None:
    text, reason = generate(compiler, "hermes", seed=0, parallel=False)
    assert reason is FinishReason.STOP and text.endswith("</tool_call>")
    assert len(parse("hermes", text)[1]) == 1


def test_issue26_v_no_opener_no_constraint(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    """Until the opener appears, the processor changes nothing: the same seed writes the same tokens."""
    lazy = compiler.triggered_tool_calls("hermes", TOOLS, read_tool_choice("auto"))
    assert lazy is not None
    processor = make_lazy_processor(compiler, lazy)
    with_processor, _ = drive([processor], tokenizer.vocab_size, seed=5, max_steps=60)
    without, _ = drive([], tokenizer.vocab_size, seed=5, max_steps=60)
    assert with_processor == without
    assert isinstance(processor, LazyGrammarProcessor) and not processor.is_constrained


def test_issue26_v_only_auto_with_an_opener_gets_a_lazy_grammar(compiler: GrammarCompiler) -> None:
    for choice in ("none", "required", {"type": "function", "function": {"name": "ping"}}):
        assert compiler.triggered_tool_calls("hermes", TOOLS, read_tool_choice(choice)) is None
    assert compiler.triggered_tool_calls("hermes", [], read_tool_choice("auto")) is None
    # A schema llguidance cannot compile leaves the reply free (logged), never a 400.
    weird = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}, "required": ["a"]}}}]
    assert compiler.triggered_tool_calls("hermes", weird, read_tool_choice("auto")) is None
