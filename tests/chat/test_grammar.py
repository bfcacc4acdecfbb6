"""Constrained decoding (V) on the real SmolLM2 vocabulary with llguidance.

Random logits stand in for a model that knows nothing about the format: whatever it "wants",
the grammar processor must make every output valid. Outputs are checked with `jsonschema`,
`re` and the tool-call parsers that read real replies.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
import torch

from mlxcel.api.chat_options import read_tool_choice
from mlxcel.chat.events import ToolCallStart
from mlxcel.chat.grammar import Grammar, GrammarCompiler, GrammarError
from mlxcel.chat.reasoning import ThinkTokens, infer_think_tokens
from mlxcel.text.tokenizer import Tokenizer
from mlxcel.chat.tools import make_tool_parser
from mlxcel.chat.tools.base import collect_tool_calls
from mlxcel.types import FinishReason, SamplingParams
from tests.chat.drive import drive, single_thread  # noqa: F401 - autouse fixture
from tests.chat.wire import constraints

pytestmark = pytest.mark.slow  # reads the SmolLM2 GGUF vocabulary

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
        "member": {"type": "boolean"},
        "score": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": -5, "maximum": 5}]},
    },
    "required": ["name", "age", "tags", "member", "score"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def tokenizer(smollm2_metadata: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_metadata)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer)


def generate(compiler: GrammarCompiler, grammar: Grammar, seed: int, **options: Any) -> tuple[str, FinishReason]:
    tokenizer = compiler.tokenizer
    processor = compiler.processor(grammar, think=options.pop("think", None),
                                   starts_in_reasoning=options.pop("starts_in_reasoning", False))
    # The model's logits row is wider than the vocabulary (padded embeddings, as real models have).
    tokens, reason = drive([processor], tokenizer.vocab_size + 64, seed=seed,
                           eos_token_ids=tokenizer.eos_token_ids, **options)
    assert max(tokens) < tokenizer.vocab_size
    return tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids]), reason


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}},
    {"json_schema": PERSON},  # llama-server
    {"text": {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}},  # responses
    {"output_format": {"type": "json_schema", "schema": PERSON}},  # anthropic
])  # fmt: skip
def test_v_every_output_validates_against_the_schema(compiler: GrammarCompiler, body: dict[str, Any]) -> None:
    grammar = compiler.from_constraints(constraints(body))
    assert grammar is not None
    for seed in range(8):
        text, reason = generate(compiler, grammar, seed)
        assert reason is FinishReason.STOP, text
        jsonschema.validate(json.loads(text), PERSON)
        # Spaced as json.dumps spaces it: no free whitespace for a model to loop on (numbers such
        # as -0 or 1.50 are valid JSON that json.dumps would write otherwise).
        outside_strings = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
        assert re.fullmatch(r"[^\s,:]*(?:[,:] [^\s,:]*)*", outside_strings), text


def closing_bias(tokenizer: Tokenizer) -> Callable[[torch.Tensor, list[int]], None]:
    """A 'model' that likes to close strings and objects, so free-form JSON ends soon."""
    closers = [i for i in range(tokenizer.vocab_size) if any(c in tokenizer.decode([i]) for c in '"}]')]

    def steer(logits: torch.Tensor, output: list[int]) -> None:
        logits[closers] += 4.0
    return steer


def test_v_json_object_gives_an_object(compiler: GrammarCompiler) -> None:
    grammar = compiler.from_constraints(constraints({"response_format": {"type": "json_object"}}))
    assert grammar is not None
    steer = closing_bias(compiler.tokenizer)
    for seed in range(4):
        text, _ = generate(compiler, grammar, seed, steer=steer)
        assert isinstance(json.loads(text), dict), text


def test_v_gbnf_grammar(compiler: GrammarCompiler) -> None:
    gbnf = 'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [a-z] [a-z] [a-z]?\n'
    grammar = compiler.from_constraints(constraints({"grammar": gbnf}))
    assert grammar is not None
    for seed in range(8):
        text, reason = generate(compiler, grammar, seed)
        assert re.fullmatch(r"(hello|hi) [a-z]{2,3}!", text), text
        assert reason is FinishReason.STOP


def test_v_lark_and_regex(compiler: GrammarCompiler) -> None:
    lark = compiler.lark('start: "x=" NUM ";"\nNUM: /[0-9]{1,3}/')
    regex = compiler.regex(r"(yes|no)\.")
    for seed in range(4):
        assert re.fullmatch(r"x=[0-9]{1,3};", generate(compiler, lark, seed)[0])
        assert re.fullmatch(r"(yes|no)\.", generate(compiler, regex, seed)[0])


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral", "generic"])
@pytest.mark.parametrize("parallel", [True, False])
def test_v_required_tool_choice_always_gives_well_formed_calls(
    compiler: GrammarCompiler, fmt: str, parallel: bool
) -> None:
    grammar = compiler.tool_calls(fmt, TOOLS, read_tool_choice("required"), parallel=parallel)
    assert grammar is not None
    for seed in range(4):
        text, _ = generate(compiler, grammar, seed)
        parser = make_tool_parser(fmt)
        events = parser.feed(text) + parser.finish()
        calls = collect_tool_calls(events)
        assert calls, text
        assert len(calls) == 1 or parallel
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert sum(isinstance(e, ToolCallStart) for e in events) == len(calls)


@pytest.mark.parametrize("choice", [
    {"type": "function", "function": {"name": "get_weather"}},  # chat
    {"type": "function", "name": "get_weather"},  # responses
    {"type": "tool", "name": "get_weather"},  # anthropic
])  # fmt: skip
def test_v_named_tool_choice_calls_that_tool(compiler: GrammarCompiler, choice: dict[str, Any]) -> None:
    grammar = compiler.tool_calls("hermes", TOOLS, read_tool_choice(choice), parallel=False)
    assert grammar is not None
    for seed in range(3):
        text, _ = generate(compiler, grammar, seed)
        parser = make_tool_parser("hermes")
        calls = collect_tool_calls(parser.feed(text) + parser.finish())
        assert [c.name for c in calls] == ["get_weather"]


def test_v_auto_and_none_tool_choice_add_no_grammar(compiler: GrammarCompiler) -> None:
    for choice in (None, "auto", "none", {"type": "auto"}, {"type": "none"}):
        assert compiler.tool_calls("hermes", TOOLS, read_tool_choice(choice)) is None


def test_v_grammar_waits_for_the_reasoning_block(smollm2_metadata: dict[str, Any]) -> None:
    """A thinking model reasons freely; the JSON constraint starts after `</think>`."""
    tokenizer = Tokenizer.from_gguf(smollm2_metadata)
    tokenizer.backend.add_special_tokens(["<think>", "</think>"])
    think = infer_think_tokens(tokenizer)
    assert isinstance(think, ThinkTokens)
    compiler = GrammarCompiler(tokenizer)
    grammar = compiler.json_schema(PERSON)

    def steer(logits: torch.Tensor, output: list[int]) -> None:
        logits[think.end_ids[0]] = 1e9 if len(output) == 6 else -1e9  # close after 6 free tokens

    for seed in range(3):
        text, reason = generate(compiler, grammar, seed, think=think, starts_in_reasoning=True, steer=steer)
        reasoning, _, answer = text.partition("</think>")
        assert reason is FinishReason.STOP
        jsonschema.validate(json.loads(answer), PERSON)


@pytest.mark.parametrize(("body", "message"), [
    ({"json_schema": {"type": "strin"}}, "json_schema: Invalid type: strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "properties": {"a": {"type": "string", "format": "weird"}}}, "strict": True}}},
     "response_format.json_schema.schema: Unknown format: weird"),
    ({"grammar": "root ::= undefined_rule"}, "grammar: .*undefined_rule"),
    ({"grammar": 'root ::= "a"', "json_schema": {}}, "json_schema and grammar cannot be used together"),
    ({"response_format": {"type": "xml"}}, "response_format.type must be text, json_object or json_schema"),
    ({"json_schema": "not a schema"}, "json_schema must be a JSON Schema object"),
])  # fmt: skip
def test_v_bad_schemas_and_grammars_are_400s(compiler: GrammarCompiler, body: dict[str, Any], message: str) -> None:
    with pytest.raises(GrammarError, match=message):
        compiler.from_constraints(constraints(body))


def test_v_no_constraint(compiler: GrammarCompiler) -> None:
    assert compiler.from_constraints(constraints({})) is None
    assert compiler.from_constraints(constraints({"response_format": {"type": "text"}})) is None


def test_v_tool_choice_errors(compiler: GrammarCompiler) -> None:
    with pytest.raises(GrammarError, match="names the function 'nope', which is not among the tools"):
        compiler.tool_calls("hermes", TOOLS, read_tool_choice({"type": "function", "function": {"name": "nope"}}))
    with pytest.raises(GrammarError, match="the request has no tools"):
        compiler.tool_calls("hermes", [], read_tool_choice("required"))
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]
    with pytest.raises(GrammarError, match="tools"):
        compiler.tool_calls("hermes", bad_tool, read_tool_choice("required"))


def test_v_eos_is_allowed_only_where_the_grammar_may_end(compiler: GrammarCompiler) -> None:
    grammar = compiler.gbnf('root ::= "ab" | "abc"')
    processor = compiler.processor(grammar)
    eos = sorted(compiler.tokenizer.eos_token_ids)
    assert not processor.allowed_mask(compiler.tokenizer.vocab_size)[eos].any()
    for token in compiler.tokenizer.encode("ab", add_special_tokens=False):
        assert processor.accept(token) is None
    assert processor.is_accepting
    assert processor.allowed_mask(compiler.tokenizer.vocab_size)[eos].all()


def test_issue25_grammar_masks_apply_as_one_batch_equal_to_each_row_alone(compiler: GrammarCompiler) -> None:
    """Issue 25: the sampler masks every grammar row of a step at once (one packed bitmask); each row ends as the
    grammar alone would leave it: a JSON grammar, one whose reply may open with reasoning (the start marker
    allowed too), one inside a started marker (only its next token), one reasoning (free), beside a row with no
    grammar and a lazy tool-call grammar not yet triggered."""
    from mlxcel.chat.lazy_grammar import make_lazy_processor
    from mlxcel.engine.sampler import SamplingRow, _apply_processors

    vocab = compiler.tokenizer.vocab_size
    think = ThinkTokens("<t1><t2>", "</t>", (1000, 1001), (1002,))
    json_grammar = compiler.from_constraints(constraints({"response_format": {"type": "json_object"}}))
    plain = compiler.processor(json_grammar)
    before = compiler.processor(json_grammar, think=think)
    inside_marker = compiler.processor(json_grammar, think=think)
    assert inside_marker.accept(1000) is None  # the first start-marker token: only 1001 may follow
    reasoning = compiler.processor(json_grammar, think=think, starts_in_reasoning=True)
    lazy_grammar = compiler.triggered_tool_calls("hermes", TOOLS, read_tool_choice("auto"))
    assert lazy_grammar is not None
    lazy = make_lazy_processor(compiler, lazy_grammar)
    processors = [(plain,), (), (before,), (inside_marker,), (reasoning,), (lazy,)]
    rows = [SamplingRow(SamplingParams(temperature=1.0), [5, 6, 7], 0, frozenset(), processors=p) for p in processors]
    logits = torch.randn(len(rows), vocab + 7, generator=torch.Generator().manual_seed(25))  # ids past the vocabulary
    work = logits.clone()
    _apply_processors(work, rows)

    def allowed(ids: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(vocab + 7, dtype=torch.bool)
        mask[ids] = True
        return mask

    grammar_only = torch.cat([plain.allowed_mask(vocab), torch.zeros(7, dtype=torch.bool)])
    expected = [grammar_only, torch.ones(vocab + 7, dtype=torch.bool), grammar_only | allowed(torch.tensor([1000])),
                allowed(torch.tensor([1001])), torch.ones(vocab + 7, dtype=torch.bool),
                torch.ones(vocab + 7, dtype=torch.bool)]
    for i, mask in enumerate(expected):
        assert torch.equal(torch.isfinite(work[i]), mask), i
        assert torch.equal(work[i][mask], logits[i][mask]), i  # the allowed tokens keep their logits
    assert 0 < int(grammar_only.sum()) < vocab
