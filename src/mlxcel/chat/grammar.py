"""Constrained decoding (spec V) on llguidance: JSON schema, JSON object, GBNF, Lark, regex, and
the tool-call grammar that makes `tool_choice: required` / a named tool always well-formed; under
`tool_choice: auto` the same call grammar applies lazily, from the format's opener on (issue 26,
chat/lazy_grammar.py).

llguidance (not a hand-written engine, DESIGN.md) compiles the grammar against the vocabulary;
`GrammarProcessor` is a per-request TokenProcessor: each step it masks the logits row to the
tokens the matcher allows, and each sampled token advances the matcher. Constrained and free
requests share a batch, since the mask is per row.

    compiler = GrammarCompiler(tokenizer)                 # once per served model
    grammar = compiler.from_constraints(options.output)  # GrammarError (a 400) before generating
    processor = compiler.processor(grammar, think=think, starts_in_reasoning=primed)

With reasoning markers, the grammar waits while the model reasons: the reply may open with the
start marker, and the grammar applies from the end marker on.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema
import llguidance
import torch

from mlxcel.chat.options import OutputConstraint, ToolChoice
from mlxcel.chat.reasoning import ThinkTokens, ThinkTracker
from mlxcel.text.tokenizer import Tokenizer
from mlxcel.chat.tools import format_module
from mlxcel.types import FinishReason, apply_masks

log = logging.getLogger(__name__)

# JSON is written as json.dumps writes it: no free whitespace, so a model cannot loop on spaces.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)
FUNCTION_TOOL_TYPES = ("function", "custom")  # chat/responses "function", Anthropic "custom" (or no type)
PROBE_STEPS = 8  # tokens walked at validation, to meet the grammars llguidance gives up on


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled; the message is fit for a 400 reply."""


@dataclass(frozen=True, slots=True)
class Grammar:
    """A validated llguidance grammar and the request field it came from."""

    text: str  # llguidance's grammar JSON
    source: str  # e.g. "response_format.json_schema.schema"


@dataclass(frozen=True, slots=True)
class LazyGrammar:
    """A grammar that applies from `trigger` on: the reply is free until the pattern matches its
    text, then the grammar constrains what follows the match until it is complete."""

    grammar: Grammar
    trigger: re.Pattern[str]
    is_repeatable: bool  # the reply goes on freely after a constrained part (else it ends there)


class GrammarCompiler:
    """Compiles grammars for one vocabulary. Building llguidance's tokenizer takes about a
    second, so it is done once, on first use."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._llg: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._llg is None:
                self._llg = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(),
                    n_vocab=self.tokenizer.vocab_size,
                    eos_token=sorted(self.tokenizer.eos_token_ids),
                )
            return self._llg

    # --- grammars from their sources -----------------------------------------------------------

    def json_schema(self, schema: Any, *, strict: bool = False, source: str = "json_schema") -> Grammar:
        """A grammar for JSON matching `schema`. Strict: a keyword llguidance cannot enforce is
        an error; otherwise it is ignored (OpenAI's non-strict mode, llama-server)."""
        if isinstance(schema, bool) or not isinstance(schema, Mapping):
            raise GrammarError(f"{source} must be a JSON Schema object")
        options = {**JSON_LAYOUT, "lenient": not strict}
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
        except ValueError as exc:
            raise GrammarError(f"{source}: {exc}") from None
        return self._validated(text, source)

    def json_object(self, *, source: str = "response_format") -> Grammar:
        """Any JSON object."""
        return self.json_schema({"type": "object"}, source=source)

    def gbnf(self, text: str, *, source: str = "grammar") -> Grammar:
        """llama.cpp GBNF (a Lark grammar is recognised and accepted too)."""
        if not isinstance(text, str) or not text.strip():
            raise GrammarError(f"{source} must be a non-empty grammar string")
        try:
            grammar = llguidance.grammar_from("gbnf", text)
        except ValueError as exc:
            raise GrammarError(f"{source}: {exc}") from None
        return self._validated(grammar, source)

    def lark(self, text: str, *, source: str = "lark") -> Grammar:
        return self._validated(llguidance.LLMatcher.grammar_from_lark(text), source)

    def regex(self, pattern: str, *, source: str = "regex") -> Grammar:
        return self._validated(llguidance.LLMatcher.grammar_from_regex(pattern), source)

    def _validated(self, text: str, source: str) -> Grammar:
        matcher = llguidance.LLMatcher(self.llg_tokenizer, text, log_level=0)
        error = matcher.get_error() if matcher.is_error() else _probe(matcher, self.tokenizer.eos_token_ids)
        if error:
            raise GrammarError(f"{source}: {_first_line(error)}")
        return Grammar(text, source)

    # --- requests --------------------------------------------------------------------------------

    def from_constraints(self, constraints: Sequence[OutputConstraint]) -> Grammar | None:
        """The output constraint a request asks for (its adapter lists every one it was given).
        None when it asks for none (a plain-text format counts as none); GrammarError when it is
        invalid or asks for two."""
        found = [c for c in constraints if c.value is not None and not _is_plain_text(c)]
        if not found:
            return None
        if len(found) > 1:
            names = " and ".join(c.source for c in found)
            raise GrammarError(f"{names} cannot be used together; give one output constraint")
        constraint = found[0]
        if constraint.kind == "gbnf":
            return self.gbnf(constraint.value, source=constraint.source)
        if constraint.kind == "json_schema":
            return self.json_schema(constraint.value, source=constraint.source)
        return self._from_format(constraint.value, constraint.source)

    def _from_format(self, spec: Any, source: str) -> Grammar:
        if not isinstance(spec, Mapping):
            raise GrammarError(f"{source} must be an object")
        kind = spec.get("type")
        if kind == "json_object":
            schema = spec.get("schema")
            return self.json_schema(schema, source=f"{source}.schema") if schema else self.json_object(source=source)
        if kind != "json_schema":
            raise GrammarError(f"{source}.type must be text, json_object or json_schema, not {kind!r}")
        # Chat nests {"json_schema": {"name", "schema", "strict"}}; responses/anthropic are flat.
        inner = spec.get("json_schema", spec)
        if not isinstance(inner, Mapping):
            raise GrammarError(f"{source}.json_schema must be an object")
        schema = inner.get("schema", {"type": "object"})
        where = f"{source}.json_schema.schema" if "json_schema" in spec else f"{source}.schema"
        return self.json_schema(schema, strict=inner.get("strict") is True, source=where)

    def tool_calls(
        self, fmt: str, tools: Sequence[Mapping[str, Any]] | None, tool_choice: ToolChoice, *, parallel: bool = True
    ) -> Grammar | None:
        """For `tool_choice` required (or a named function): a grammar whose every output is a
        well-formed call in the template's format `fmt` (a tools.FORMATS key). None for
        auto/none. Accepts the OpenAI, Responses and Anthropic shapes of tools."""
        chosen = _chosen_tools(tools or (), tool_choice)
        if chosen is None:
            return None
        module = format_module(fmt)
        if hasattr(module, "lark_tools"):  # the name outside the JSON: the format writes the whole grammar
            lark = module.lark_tools(chosen, self._lark_literal, arguments_json, parallel=parallel, after_trigger=False)
        else:
            schema = _calls_schema(chosen, module.ARGUMENTS_KEY)
            calls = module.lark_calls("call", self._lark_literal, parallel=parallel)
            lark = f"start: {calls}\ncall: %json {json.dumps(schema)}\n"
        return self._validated(llguidance.LLMatcher.grammar_from_lark(lark), "tools")

    def triggered_tool_calls(
        self, fmt: str, tools: Sequence[Mapping[str, Any]] | None, tool_choice: ToolChoice, *, parallel: bool = True
    ) -> LazyGrammar | None:
        """For `tool_choice` auto: the forced call grammar, applied from the format's call opener
        on, so a call names a declared tool with arguments that fit its schema. None where the
        format has no opener, and where llguidance cannot compile the tools' schemas (logged:
        the reply then stays free, and the parser still refuses undeclared names)."""
        module = format_module(fmt)
        trigger: re.Pattern[str] | None = getattr(module, "TRIGGER", None)
        if tool_choice.mode != "auto" or not tools or trigger is None:
            return None
        available = [tool_name_and_parameters(t) for t in tools if t.get("type", "function") in FUNCTION_TOOL_TYPES]
        if not available:
            return None
        if hasattr(module, "lark_tools"):
            text = module.lark_tools(available, self._lark_literal, arguments_json, parallel=parallel, after_trigger=True)
        else:
            schema = _calls_schema(available, module.ARGUMENTS_KEY)
            rest = module.lark_after_trigger("call", self._lark_literal, parallel=parallel)
            text = f"start: {rest}\ncall: %json {json.dumps(schema)}\n"
        try:
            lark = llguidance.LLMatcher.grammar_from_lark(text)
            grammar = self._validated(lark, "tools")
        except (GrammarError, ValueError) as exc:
            log.warning("tool calls are not constrained for this request: %s", _first_line(str(exc)))
            return None
        return LazyGrammar(grammar, trigger, is_repeatable=parallel)

    def _lark_literal(self, text: str) -> str:
        """Lark for `text`, or its special token where the vocabulary has one: llguidance matches
        a special token by its id only, never by its text. Special is what either side says: a GGUF's
        user-defined `<tool_call>` (Qwen2.5) is text to our tokenizer but special to llguidance, whose
        mask then offered the token for the literal and refused it when taken (issue 46)."""
        literal = json.dumps(text)
        token_id = self.tokenizer.token_to_id(text)
        if token_id is not None and (token_id in self.tokenizer.special_token_ids
                                     or self.llg_tokenizer.is_special_token(token_id)):
            return f"({literal} | <[{token_id}]>)"
        return literal

    def check_tools(self, tools: Sequence[Any] | None) -> None:
        """GrammarError (a 400) for a function tool without a name or whose parameters are not a
        valid JSON Schema (checked against the 2020-12 meta-schema): refused before generating."""
        for index, tool in enumerate(tools or ()):
            if not isinstance(tool, Mapping):
                raise GrammarError(f"tools.{index}: a tool must be an object")
            if tool.get("type", "function") not in FUNCTION_TOOL_TYPES:
                continue  # a built-in tool kind (web_search, ...): no schema of the client's
            name, parameters = tool_name_and_parameters(tool)
            try:
                jsonschema.Draft202012Validator.check_schema(parameters)
            except jsonschema.SchemaError as exc:
                where = "/".join(str(p) for p in exc.absolute_path) or "the root"
                raise GrammarError(f"tools.{index} ({name}): parameters are not a valid JSON Schema "
                                   f"(at {where}: {exc.message[:200]})") from None

    def processor(
        self, grammar: Grammar, *, think: ThinkTokens | None = None, starts_in_reasoning: bool = False
    ) -> GrammarProcessor:
        """A fresh TokenProcessor for one request (one per choice)."""
        matcher = llguidance.LLMatcher(self.llg_tokenizer, grammar.text, log_level=0)
        tracker = ThinkTracker(think, starts_in_reasoning=starts_in_reasoning) if think is not None else None
        return GrammarProcessor(matcher, self.tokenizer.eos_token_ids, tracker, source=grammar.text)


# issue 25: a fresh processor handed to the engine process (--engine-process on) is rebuilt there from
# its grammar's text over that process's compiler, which the engine process registers once it has the
# tokenizer (a matcher itself does not pickle).
_copies_compiler: GrammarCompiler | None = None


def compile_copies_with(compiler: GrammarCompiler) -> None:
    global _copies_compiler
    _copies_compiler = compiler


def copies_compiler() -> GrammarCompiler:
    if _copies_compiler is None:
        raise RuntimeError("no grammar compiler in this process for a processor handed over from another")
    return _copies_compiler


def _rebuilt_processor(source: str, eos_token_ids: frozenset[int], tracker: ThinkTracker | None) -> GrammarProcessor:
    matcher = llguidance.LLMatcher(copies_compiler().llg_tokenizer, source, log_level=0)
    return GrammarProcessor(matcher, eos_token_ids, tracker, source=source)


def _probe(matcher: llguidance.LLMatcher, eos_token_ids: frozenset[int]) -> str | None:
    """Walk a few tokens down one path of a fresh matcher: llguidance gives up on some grammars
    (ParserTooComplex, "too many items", no text at all) only once it computes a mask or takes a
    token, and that must be a 400 before generation, not a reply cut short at its first token."""
    for _ in range(PROBE_STEPS):
        packed = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
        if matcher.is_error():
            return matcher.get_error()
        allowed = ((packed.unsqueeze(1) >> _BIT_SHIFTS) & 1).flatten().nonzero().flatten().tolist()
        candidates = [t for t in allowed if t not in eos_token_ids]
        if not candidates:
            return None
        matcher.consume_token(candidates[-1])
        if matcher.is_error():
            return matcher.get_error()
        if matcher.is_stopped():
            return None
    return None


def _first_line(error: str) -> str:
    line = error.strip().splitlines()[0] if error.strip() else "invalid grammar"
    return "the grammar matches no text" if line == "NoExtensionBias" else line


def _is_plain_text(constraint: OutputConstraint) -> bool:
    value = constraint.value
    return constraint.kind == "format" and isinstance(value, Mapping) and value.get("type") == "text"


# --- tools ---------------------------------------------------------------------------------------


def tool_name_and_parameters(tool: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """(name, parameters schema) of a tool in the OpenAI chat, Responses or Anthropic shape."""
    function = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise GrammarError("every tool needs a function name")
    parameters = function.get("parameters", function.get("input_schema")) or {"type": "object"}
    if not isinstance(parameters, Mapping):
        raise GrammarError(f"tool {name!r}: parameters must be a JSON Schema object")
    return name, parameters


def declared_tool_names(tools: Sequence[Any] | None) -> frozenset[str]:
    """The names a reply's tool calls may use: every named tool of the request, in any shape."""
    names = set()
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            continue
        function = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
        name = function.get("name")
        if isinstance(name, str) and name:
            names.add(name)
    return frozenset(names)


def _chosen_tools(tools: Sequence[Mapping[str, Any]], choice: ToolChoice) -> list[tuple[str, Mapping[str, Any]]] | None:
    """The tools a call must use, or None when tool_choice forces nothing."""
    if not choice.is_forced:
        return None
    available = [tool_name_and_parameters(t) for t in tools]
    if not available:
        raise GrammarError("tool_choice requires a tool call, but the request has no tools")
    if choice.name is None:
        return available
    chosen = [t for t in available if t[0] == choice.name]
    if not chosen:
        raise GrammarError(f"tool_choice names the function {choice.name!r}, which is not among the tools")
    return chosen


def arguments_json(parameters: Mapping[str, Any]) -> str:
    """Lark for one call's arguments object, as the JSON of the call grammars is written (for
    formats whose name is outside the JSON: their `lark_tools`)."""
    return f"%json {json.dumps({**parameters, 'x-guidance': {**JSON_LAYOUT, 'lenient': True}})}"


def _calls_schema(tools: list[tuple[str, Mapping[str, Any]]], arguments_key: str) -> dict[str, Any]:
    """One call object: {"name": <a chosen tool>, <arguments_key>: <its parameters>}."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, arguments_key: dict(parameters)},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for name, parameters in tools
    ]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": {**JSON_LAYOUT, "lenient": True}}


# --- the processor ---------------------------------------------------------------------------------


def _allow(words: torch.Tensor, token_id: int) -> None:
    """Set token `token_id`'s bit in a row of int32 mask words (little-endian: bit t % 8 of byte t // 8)."""
    if 0 <= token_id < words.numel() * 32:
        words.view(torch.uint8)[token_id // 8] |= 1 << token_id % 8


class GrammarProcessor:
    """A TokenProcessor holding one request's llguidance matcher.

    `process` masks a logits row to the allowed tokens (end-of-sequence only where the grammar
    may end); `accept` advances the matcher and returns STOP once the grammar is complete.
    """

    def __init__(
        self, matcher: llguidance.LLMatcher, eos_token_ids: frozenset[int], tracker: ThinkTracker | None,
        *, source: str | None = None,
    ) -> None:
        self.matcher = matcher
        self._eos = eos_token_ids
        self._tracker = tracker
        self._source = source  # the grammar's text: a fresh copy is rebuilt from it in another process

    def __reduce__(self) -> tuple:
        if self._source is None:
            raise TypeError("a grammar processor without its grammar's text cannot be copied")
        return _rebuilt_processor, (self._source, self._eos, self._tracker)

    def process(self, logits: torch.Tensor, output_ids: Sequence[int]) -> None:
        words = torch.empty(-(-logits.shape[-1] // 32), dtype=torch.int32)
        if self.fill_mask(words):
            apply_masks(logits.unsqueeze(0), words.unsqueeze(0))

    def fill_mask(self, words: torch.Tensor) -> bool:
        """The tokens allowed next as bits of `words` (int32, on the host: token t is bit t % 32 of word
        t // 32; ids past the grammar's vocabulary are not allowed), for the sampler's one masked batch
        (issue 25). False when the grammar masks nothing now (while the reply reasons)."""
        tracker = self._tracker
        if tracker is not None and tracker.phase == ThinkTracker.REASONING:
            return False  # free while reasoning
        if tracker is not None and tracker.phase == ThinkTracker.BEFORE and tracker.num_start_matched:
            words.zero_()
            _allow(words, tracker.think.start_ids[tracker.num_start_matched])
            return True
        packed = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
        count = min(packed.numel(), words.numel())
        words[:count] = packed[:count]
        words[count:] = 0
        if tracker is not None and tracker.phase == ThinkTracker.BEFORE:
            _allow(words, tracker.think.start_ids[0])  # the reply may open with reasoning
        return True

    def allowed_mask(self, width: int) -> torch.Tensor:
        """[width] bool: the tokens the grammar allows next (ids past the vocabulary: none)."""
        packed = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
        bits = ((packed.unsqueeze(1) >> _BIT_SHIFTS) & 1).flatten().bool()  # little-endian bit order
        if bits.numel() >= width:
            return bits[:width].clone()
        return torch.cat([bits, torch.zeros(width - bits.numel(), dtype=torch.bool)])

    def accept(self, token_id: int) -> FinishReason | None:
        if self._tracker is not None and self._tracker.advance(token_id):
            return None  # a reasoning token: the grammar has not started
        if token_id in self._eos:
            return FinishReason.STOP
        if not self.matcher.consume_token(token_id):
            # Only possible when something after the mask changed the choice; end cleanly.
            log.warning("grammar rejected sampled token %d: %s", token_id, self.matcher.get_error())
            return FinishReason.STOP
        return FinishReason.STOP if self.matcher.is_stopped() else None

    @property
    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()
