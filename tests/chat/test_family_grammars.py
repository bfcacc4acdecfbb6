"""Issue 40 (V): the call grammars of the newer families' formats, on the real SmolLM2 vocabulary.

Under `tool_choice` required, random logits through the grammar always give a call that the
format's parser reads, naming a declared tool with arguments that fit its schema (for the XML
formats, whose values are free text: a declared tool and declared parameter names). Under
`auto`, a steered "model" that writes the format's opener and then a call to an undeclared tool
is turned to a declared one from the opener on, with the text before it left free.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch

from mlxcel.api.chat_options import read_tool_choice
from mlxcel.chat.events import ContentDelta, OutputEvent
from mlxcel.chat.grammar import GrammarCompiler, declared_tool_names
from mlxcel.chat.harmony import HARMONY_MARKERS
from mlxcel.chat.lazy_grammar import make_lazy_processor
from mlxcel.chat.output import ChatOutputParser
from mlxcel.chat.reasoning import ThinkTokens
from mlxcel.chat.tools import make_tool_parser
from mlxcel.chat.tools.base import collect_tool_calls
from mlxcel.text.tokenizer import Tokenizer
from mlxcel.types import FinishReason
from tests.chat.drive import Steer, drive, single_thread  # noqa: F401 - autouse fixture
from tests.chat.test_grammar import SCHEMAS, TOOLS, compiler, generate, tokenizer  # noqa: F401 - fixtures
from tests.chat.test_tool_call_trigger import scripted

pytestmark = pytest.mark.slow  # reads the SmolLM2 GGUF vocabulary

JSON_FORMATS = ["harmony", "deepseek", "mistral_args"]
XML_FORMATS = ["qwen3_coder", "glm45"]


def parse(fmt: str, text: str) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """Content and calls, as the server reads the reply (harmony through its channel splitter)."""
    tool_parser = make_tool_parser(fmt, declared=declared_tool_names(TOOLS), tools=TOOLS)
    think = ThinkTokens(*HARMONY_MARKERS, (1,), (2,)) if fmt == "harmony" else None
    parser = ChatOutputParser(think=think, tool_parser=tool_parser)
    events: list[OutputEvent] = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return content, [(c.name, json.loads(c.arguments)) for c in collect_tool_calls(events)]


@pytest.mark.parametrize("fmt", JSON_FORMATS + XML_FORMATS)
@pytest.mark.parametrize("parallel", [True, False])
def test_issue40_v_required_tool_choice_gives_calls_the_parser_reads(
    compiler: GrammarCompiler, fmt: str, parallel: bool  # noqa: F811 - the fixture
) -> None:
    grammar = compiler.tool_calls(fmt, TOOLS, read_tool_choice("required"), parallel=parallel)
    assert grammar is not None
    for seed in range(3):
        steer = closing(compiler.tokenizer, CLOSERS[fmt]) if fmt in CLOSERS else None
        text, _ = generate(compiler, grammar, seed, steer=steer)
        content, calls = parse(fmt, text)
        assert calls and not content.strip(), text
        assert len(calls) == 1 or parallel
        check_arguments(fmt, calls, text)


# The closing tags of a free-text value (XML formats), which a steered model writes soon.
CLOSERS = {"qwen3_coder": ["\n</parameter>\n", "</function>"], "glm45": ["</arg_value>", "</tool_call>"]}


def closing(tokenizer: Tokenizer, closers: list[str]) -> Steer:
    """Random logits, steered to write one of `closers` a few tokens into a value, and to finish
    one once started (the grammar's mask still decides what may come)."""
    pieces = [tokenizer.encode(c, add_special_tokens=False) for c in closers]

    def steer(logits: torch.Tensor, output: list[int]) -> None:
        for piece in pieces:
            done = next((k for k in range(len(piece), 0, -1) if output[-k:] == piece[:k]), 0)
            if 0 < done < len(piece):
                logits[piece[done]] += 50.0
                return
        if len(output) % 4 == 3:
            for piece in pieces:
                logits[piece[0]] += 30.0
    return steer


UNDECLARED = {"name": "get_sunny_city", "arguments": {"city": "Oslo"}}
SCRIPTS = {
    "harmony": ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_sunny_city <|constrain|>json<|message|>{"city": "Oslo"}', "Checking."),
    "deepseek": ("Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_sunny_city<｜tool▁sep｜>"
                 '{"city": "Oslo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Sure."),
    "mistral_args": ('Sure.[TOOL_CALLS]get_sunny_city[ARGS]{"city": "Oslo"}', "Sure."),
    "qwen3_coder": ("Sure.\n<tool_call>\n<function=get_sunny_city>\n<parameter=city>\nOslo\n</parameter>\n"
                    "</function>\n</tool_call>", "Sure."),
    "glm45": ("Sure.<tool_call>get_sunny_city\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>",
              "Sure."),
}  # fmt: skip


@pytest.mark.parametrize("fmt", list(SCRIPTS))
def test_issue40_v_auto_call_after_the_opener_names_a_declared_tool(
    compiler: GrammarCompiler, fmt: str  # noqa: F811 - the fixture
) -> None:
    tokenizer = compiler.tokenizer
    script, before = SCRIPTS[fmt]
    lazy = compiler.triggered_tool_calls(fmt, TOOLS, read_tool_choice("auto"))
    assert lazy is not None
    for seed in range(3):
        steer = scripted(tokenizer, script)
        free, _ = drive([], tokenizer.vocab_size, seed=seed, eos_token_ids=tokenizer.eos_token_ids, steer=steer,
                        max_steps=150)
        assert parse(fmt, tokenizer.decode(free))[1] == []  # the script's call names no declared tool
        tokens, reason = drive([make_lazy_processor(compiler, lazy)], tokenizer.vocab_size, seed=seed,
                               eos_token_ids=tokenizer.eos_token_ids, steer=script_then_close(fmt, tokenizer, script),
                               max_steps=150)
        text = tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids])
        content, calls = parse(fmt, text)
        assert reason is FinishReason.STOP and content.strip() == before and calls, text
        check_arguments(fmt, calls, text)


def script_then_close(fmt: str, tokenizer: Tokenizer, script: str) -> Steer:
    """The script while the grammar lets it be written; then, in an XML value, its closing tags."""
    follow, close = scripted(tokenizer, script), closing(tokenizer, CLOSERS.get(fmt, []))

    def steer(logits: torch.Tensor, output: list[int]) -> None:
        follow(logits, output)
        close(logits, output)
    return steer


def check_arguments(fmt: str, calls: list[tuple[str, dict[str, Any]]], text: str) -> None:
    """JSON formats: the arguments fit the schema; XML formats: their keys are declared ones."""
    for name, arguments in calls:
        if fmt in XML_FORMATS:
            assert set(arguments) <= set(SCHEMAS[name]["properties"]), text
        else:
            jsonschema.validate(arguments, SCHEMAS[name])


@pytest.fixture(scope="module")
def qwen_marker_compiler(smollm2_metadata: dict[str, Any]) -> GrammarCompiler:
    """SmolLM2's vocabulary plus `<tool_call>` / `</tool_call>` as a Qwen2.5 GGUF has them: user-defined
    tokens, plain text to our tokenizer, special (matched by id only) to llguidance."""
    meta = dict(smollm2_metadata)
    markers = ["<tool_call>", "</tool_call>"]
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], *markers]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], 4, 4]  # USER_DEFINED
    if "tokenizer.ggml.scores" in meta:
        meta["tokenizer.ggml.scores"] = [*meta["tokenizer.ggml.scores"], 0.0, 0.0]
    return GrammarCompiler(Tokenizer.from_gguf(meta))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_issue46_forced_hermes_call_takes_the_marker_token(qwen_marker_compiler: GrammarCompiler, choice: Any) -> None:
    """A forced call in Qwen's format compiles where `<tool_call>` is a user-defined token (before: a 400, "token
    doesn't satisfy the grammar; forced bytes: got '<'", on every instructor TOOLS request to Qwen2.5-Coder-1.5B),
    and a model that writes the marker as its one token gets a call the parser reads."""
    tokenizer = qwen_marker_compiler.tokenizer
    opener, closer = tokenizer.token_to_id("<tool_call>"), tokenizer.token_to_id("</tool_call>")
    assert opener is not None and closer is not None and opener not in tokenizer.special_token_ids
    assert qwen_marker_compiler.llg_tokenizer.is_special_token(opener)
    grammar = qwen_marker_compiler.tool_calls("hermes", TOOLS, read_tool_choice(choice), parallel=False)
    assert grammar is not None

    def prefer_markers(logits: torch.Tensor, output: list[int]) -> None:
        logits[opener] += 50.0
        logits[closer] += 50.0

    for seed in range(3):
        text, reason = generate(qwen_marker_compiler, grammar, seed, steer=prefer_markers)
        assert text.startswith("<tool_call>\n") and text.rstrip().endswith("</tool_call>"), text
        _, calls = parse("hermes", text)
        assert len(calls) == 1 and reason == FinishReason.STOP, (text, reason)
        name, arguments = calls[0]
        assert name in SCHEMAS
        jsonschema.validate(arguments, SCHEMAS[name])
